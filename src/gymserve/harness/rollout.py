"""Collect rollouts: run the agent on every task of a JSON Lines file, append each finished rollout.

Input (``tasks.jsonl``), one JSON object a line (blank lines ignored)::

    {"id": "t1",                                   # optional; default "line-<N>" (1-based line number)
     "env": "weather",                             # optional; default "weather" (see gymserve.harness.envs)
     "responses_create_params": {                  # required: Responses create parameters
         "input": "What's the weather in Paris?",  #   required: a string or a list of input items
         "max_output_tokens": 64},                 #   any other create parameter; tools and
                                                   #   instructions default to the env's
     "verifier_metadata": {"cities": ["Paris"]},   # optional; passed to the env's verifier
     "max_steps": 8}                               # optional; model calls per rollout (default 8)

Output (``rollouts.jsonl``), one finished rollout a line, appended as it finishes (completion
order, not input order)::

    {"id", "env", "model",
     "responses_create_params", "verifier_metadata",     # as given in the task
     "input":  [items],           # the initial input items
     "output": [items],           # every item after the input, unchanged: model output items (the
                                  # last of each model call carries prompt_token_ids,
                                  # generation_token_ids, generation_log_probs) and the agent's
                                  # function_call_output items
     "turns": [{"index", "response_id", "status", "output_types", "prompt_token_ids",
                "generation_token_ids", "generation_log_probs", "usage", "latency_s",
                "weight_version", "weight_version_spans"}],
     "final_text", "stop_reason",  # message | max_steps | no_action | context_length | error
     "reward",                     # float in [0, 1]; null when the rollout ended with an error
     "error",                      # null or {"type", "message", "status", "code"}
     "timings": {"started_at", "finished_at", "total_s", "model_s", "tool_s"},  # unix s / seconds
     "num_turns", "generated_tokens"}

Durability: each line is written with one ``os.write`` of the complete line on an ``O_APPEND``
descriptor, synchronously inside the event loop (cancellation happens only at ``await`` points, so
it never interrupts a write). An interrupt therefore loses only rollouts still in flight.
``--resume`` drops a trailing partial line (a crash mid-write) and skips every task whose id is
already in the output, errored rollouts included. Without ``--resume`` a non-empty output file is
refused rather than appended to or overwritten.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymserve.harness.envs import ENV_NAMES, open_environments


class TaskFileError(ValueError):
    """The tasks file (or an output file to resume) is malformed; the message names the line."""


def load_tasks(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read and validate a tasks file (format in the module doc); fills default ``id`` and ``env``.

    Raises ``TaskFileError`` on invalid JSON, a missing ``responses_create_params.input``, an
    unknown env, or a duplicate id.
    """
    tasks, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{path}:{n}: not valid JSON ({exc})") from exc
            if not isinstance(task, dict):
                raise TaskFileError(f"{path}:{n}: each line must be a JSON object")
            params = task.get("responses_create_params")
            if not isinstance(params, dict) or "input" not in params:
                raise TaskFileError(
                    f'{path}:{n}: needs "responses_create_params": {{"input": ...}} (Responses create parameters)'
                )
            task.setdefault("id", f"line-{n}")
            task["id"] = str(task["id"])
            task.setdefault("env", "weather")
            if task["env"] not in ENV_NAMES:
                raise TaskFileError(f"{path}:{n}: unknown env {task['env']!r}; known: {', '.join(ENV_NAMES)}")
            if task["id"] in seen:
                raise TaskFileError(f"{path}:{n}: duplicate id {task['id']!r}; ids must be unique for --resume")
            seen.add(task["id"])
            tasks.append(task)
    return tasks


def prepare_output(path: str | os.PathLike, resume: bool) -> set[str]:
    """Make ``path`` ready for appending; return the ids already done.

    With ``resume``: truncates a trailing partial line (no final newline, or not valid JSON) and
    returns the ids of the complete lines. Raises ``TaskFileError`` when a line before the last is
    corrupt (that is not what an interrupted append leaves; a person should look at it).
    Without ``resume``: raises ``FileExistsError`` when the file exists and is non-empty.
    """
    p = Path(path)
    if not p.exists() or p.stat().st_size == 0:
        p.parent.mkdir(parents=True, exist_ok=True)
        return set()
    if not resume:
        raise FileExistsError(f"{p} already holds rollouts; pass --resume to continue it, or choose another --output")
    data = p.read_bytes()
    done: set[str] = set()
    pos = good_end = 0
    while (nl := data.find(b"\n", pos)) >= 0:  # bytes after the last newline: a partial line
        raw = data[pos:nl]
        if raw.strip():
            try:
                done.add(str(json.loads(raw)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                if not data[nl + 1 :].strip():
                    break  # a corrupt last line is dropped like a partial one (it is simply rerun)
                line_no = data.count(b"\n", 0, pos) + 1
                raise TaskFileError(f"{p}:{line_no}: corrupt rollout line ({exc}); fix or remove it") from exc
        pos = good_end = nl + 1
    if good_end != len(data):
        with open(p, "r+b") as f:
            f.truncate(good_end)
    return done


class JsonlAppender:
    """Append JSON lines to a file, one ``os.write`` per complete line (see module doc)."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fsync = fsync

    def append(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:  # a regular file takes it all at once; loop for the rare short write
            n = os.write(self.fd, view)
            view = view[n:]
        if self.fsync:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rollout_record(
    task: dict[str, Any], run: Any, env: Any, *, model: str, started_at: float, total_s: float
) -> dict[str, Any]:
    """The output line of one finished rollout (format in the module doc)."""
    reward = None
    if run.stop_reason != "error":
        reward = float(env.verify(task, run.output))
    return {
        "id": task["id"],
        "env": task["env"],
        "model": model,
        "responses_create_params": task["responses_create_params"],
        "verifier_metadata": task.get("verifier_metadata"),
        "input": run.input,
        "output": run.output,
        "turns": [t.to_dict() for t in run.turns],
        "final_text": run.final_text,
        "stop_reason": run.stop_reason,
        "reward": reward,
        "error": run.error,
        "timings": {
            "started_at": started_at,
            "finished_at": started_at + total_s,
            "total_s": total_s,
            "model_s": run.model_s,
            "tool_s": run.tool_s,
        },
        "num_turns": len(run.turns),
        "generated_tokens": sum(len(t.generation_token_ids or []) for t in run.turns),
    }


@dataclass
class RolloutSummary:
    """What a collection did: rollouts ``written`` now, ``skipped`` (already in the output),
    ``errors`` among those written, their ``mean_reward`` (None when none), wall ``elapsed_s``."""

    total: int
    skipped: int
    written: int
    errors: int
    mean_reward: float | None
    generated_tokens: int
    elapsed_s: float


async def collect_rollouts(
    tasks: list[dict[str, Any]],
    output_path: str | os.PathLike,
    *,
    client: Any,
    model: str,
    concurrency: int = 8,
    resume: bool = False,
    max_steps: int = 8,
    progress: bool = True,
    fsync: bool = False,
    envs: dict[str, Any] | None = None,
) -> RolloutSummary:
    """Run every task not yet in ``output_path``, at most ``concurrency`` at a time, appending each
    finished rollout. ``envs`` maps env names to ready environments (default: started here).

    Raises ``FileExistsError`` / ``TaskFileError`` from ``prepare_output``. On cancellation the
    in-flight rollouts are cancelled and nothing already written is touched.
    """
    from tqdm.auto import tqdm

    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    done = prepare_output(output_path, resume)
    todo = [t for t in tasks if t["id"] not in done]
    summary = RolloutSummary(len(tasks), len(tasks) - len(todo), 0, 0, None, 0, 0.0)
    if not todo:
        return summary
    t_start = time.perf_counter()
    rewards: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def run_all(env_map: dict[str, Any]) -> None:
        from gymserve.harness.agent import run_agent

        bar = tqdm(total=len(todo), unit="rollout", desc="rollouts", disable=not progress, dynamic_ncols=True)

        async def one(task: dict[str, Any]) -> None:
            async with sem:
                env = env_map[task["env"]]
                started = time.time()
                t0 = time.perf_counter()
                run = await run_agent(
                    client,
                    env,
                    task["responses_create_params"],
                    model=model,
                    max_steps=int(task.get("max_steps", max_steps)),
                    session_id=task["id"],
                )
                record = rollout_record(
                    task, run, env, model=model, started_at=started, total_s=time.perf_counter() - t0
                )
                # No await from here to the end of the write: cancellation cannot split a line.
                out.append(record)
                summary.written += 1
                summary.generated_tokens += record["generated_tokens"]
                if record["error"]:
                    summary.errors += 1
                if record["reward"] is not None:
                    rewards.append(record["reward"])
                elapsed = time.perf_counter() - t_start
                bar.set_postfix(
                    tok_s=f"{summary.generated_tokens / max(elapsed, 1e-9):.1f}",
                    reward=f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
                    errors=summary.errors,
                    refresh=False,
                )
                bar.update(1)

        workers = [asyncio.create_task(one(t)) for t in todo]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            bar.close()

    with JsonlAppender(output_path, fsync=fsync) as out:
        try:
            if envs is None:
                async with open_environments(t["env"] for t in todo) as env_map:
                    await run_all(env_map)
            else:
                await run_all(envs)
        finally:
            summary.elapsed_s = time.perf_counter() - t_start
            summary.mean_reward = sum(rewards) / len(rewards) if rewards else None
    return summary


def default_api_key() -> str:
    # A local gymserve needs none; a remote one may (GYMSERVE_API_KEY), as may an OpenAI endpoint.
    return os.environ.get("GYMSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "EMPTY"


async def served_model_name(client: Any, preferred: str | None = None) -> str:
    """``preferred`` when given, else the first model ``GET /v1/models`` lists."""
    if preferred:
        return preferred
    page = await client.models.list()
    ids = [m.id for m in page.data]
    if not ids:
        raise RuntimeError("the endpoint lists no models; pass --model")
    return ids[0]


def main_rollout(
    input_path: str,
    output_path: str,
    base_url: str | None = None,
    concurrency: int = 8,
    resume: bool = False,
    model: str | None = None,
    *,
    max_steps: int = 8,
    fsync: bool = False,
) -> int:
    """``gymserve rollout``. Without ``base_url`` serves ``model`` (default: the embedded model) in
    process; with it, ``model`` is the model name to request (default: the first one listed).

    Exit codes: 0 all tasks done without errors; 1 some rollouts recorded errors; 2 bad input or
    output file, or the endpoint could not be used; 130 interrupted (rerun with ``--resume``).
    """
    try:
        tasks = load_tasks(input_path)
        prepare_output(output_path, resume)  # fail fast, before loading a model
    except (OSError, TaskFileError) as exc:
        print(f"gymserve rollout: {exc}", file=sys.stderr)
        return 2

    server = None
    try:
        if base_url is None:
            from gymserve.config import GymserveConfig, LocalBackendConfig, ServerConfig
            from gymserve.server.run import start_background_server

            server = start_background_server(
                GymserveConfig(backend=LocalBackendConfig(model=model or "embedded"), server=ServerConfig(port=0))
            )
            base_url, model = server.base_url, None

        async def go() -> RolloutSummary:
            from openai import AsyncOpenAI

            async with AsyncOpenAI(base_url=base_url, api_key=default_api_key(), max_retries=2, timeout=600) as client:
                name = await served_model_name(client, model)
                return await collect_rollouts(
                    tasks,
                    output_path,
                    client=client,
                    model=name,
                    concurrency=concurrency,
                    resume=resume,
                    max_steps=max_steps,
                    fsync=fsync,
                )

        try:
            summary = asyncio.run(go())
        except KeyboardInterrupt:
            print(
                f"\ninterrupted: finished rollouts are in {output_path}; rerun with --resume to continue",
                file=sys.stderr,
            )
            return 130
        except Exception as exc:  # noqa: BLE001 - known failures are reported here; bugs go to the CLI's report
            from gymserve.failures import classify, report

            if classify(exc) == "bug":
                raise
            return report(exc, "rollout")
    finally:
        if server is not None:
            server.stop()

    mean = f"{summary.mean_reward:.3f}" if summary.mean_reward is not None else "n/a"
    print(
        f"{summary.written} rollouts written to {output_path} ({summary.skipped} already there), "
        f"{summary.errors} with errors, mean reward {mean}, {summary.generated_tokens} tokens generated "
        f"in {summary.elapsed_s:.1f} s"
    )
    return 1 if summary.errors else 0
