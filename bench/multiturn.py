"""Multi-turn agent rollouts: the workload where keeping a conversation's KV pays (issue #30).

``--sessions`` concurrent sessions (8; 2 with ``--quick``) × ``--turns`` turns (4): a system prompt
and a task, then after each answer a ~120-token tool result (a JSON weather report, sent as the next
user message), so each later turn's prompt is the whole earlier conversation plus the new result.
Greedy (``temperature: 0``), ``--max-tokens`` (32; 16 with ``--quick``) new tokens per turn, streamed
over ``POST /v1/chat/completions`` (aiohttp, one client process), on the embedded GGUF model (or
``--gguf``):

- ``gymserve llamacpp``: the local backend on the llamacpp engine, the answer's token fields
  (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``, on the finish chunk) sent
  back on the assistant message, so the prefix splice and the sequence's kept KV apply: a later turn
  prefills only what the earlier ones did not hold;
- ``llama-server -np N`` (``--llama-server PATH``; N = sessions): llama.cpp's own server, started with
  its own defaults (the caller's environment, ``common.start_child(caller_env=True)``), plain messages
  with ``cache_prompt: true`` (its per-slot prompt cache, the default of recent releases);
- ``gymserve transformers`` (not with ``--no-transformers``): the local backend on the transformers
  engine on the safetensors copy, with the token fields sent back as above.

Per configuration: tokens/s of finished rollouts (the generated tokens of sessions that finished all
turns ÷ the wall time from the first request to the last answer), the wall time, and the median time
to the first content token per turn. Configurations run one after another in ``--rounds`` interleaved
rounds; each round says whether the machine stayed quiet (``common.LoadWatch``).

Target: gymserve llamacpp ≥ 1.3× llama-server's tokens/s of finished rollouts (gymserve never
re-prefills a turn it already has); printed as PASS/FAIL, ``n/a`` without ``--llama-server``.

Usage: ``python bench/multiturn.py [--quick] [--sessions 8] [--turns 4] [--max-tokens 32] [--rounds 1]
[--llama-server PATH] [--no-transformers] [--gguf FILE] [--threads N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import llamacpp_peers  # noqa: E402
from engine_configs import HttpServer, start_gymserve  # noqa: E402

TARGET = 1.3  # gymserve llamacpp ÷ llama-server, tokens/s of finished rollouts
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
SYSTEM = (
    "You are a travel assistant with a weather tool. When a tool result arrives, summarise it for the "
    "user in one or two sentences and suggest what to pack. Be brief and concrete."
)
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo", "Dublin", "Athens"]


def tool_result(session: int, turn: int) -> str:
    """A ~120-token tool result (Qwen2.5's tokenizer) for ``session``'s ``turn``, as a user message."""
    city = CITIES[(session + turn) % len(CITIES)]
    report = {
        "city": city,
        "temperature_c": 8 + (session * 3 + turn) % 19,
        "conditions": ["partly cloudy", "light rain", "sunny", "overcast"][turn % 4],
        "wind_kph": 5 + (session + 7 * turn) % 30,
        "humidity": 40 + (session + turn) % 50,
        "forecast": "Mild with a light breeze; clouds clearing towards evening, a chance of showers "
        "after midnight and a cooler, brighter morning with sun by ten.",
    }
    return f"Tool result (get_weather, call {session}-{turn}):\n{json.dumps(report)}"


def first_messages(session: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Trip {session}: I am visiting three cities this week. {tool_result(session, 0)}"},
    ]


# ---------------------------------------------------------------------------------- one config
async def _turn(http: Any, url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any], int, float]:
    """One streamed chat call: (content, token fields of the finish chunk, completion tokens,
    seconds to the first content)."""
    t0 = time.perf_counter()
    ttft = float("nan")
    content: list[str] = []
    fields: dict[str, Any] = {}
    usage_tokens = None
    chunks = 0
    async with http.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if ttft != ttft:
                        ttft = time.perf_counter() - t0
                    content.append(delta["content"])
                    chunks += 1
                fields.update({k: delta[k] for k in TOKEN_FIELDS if k in delta})
    tokens = usage_tokens if usage_tokens is not None else len(fields.get("generation_token_ids") or ()) or chunks
    return "".join(content), fields, tokens, ttft


async def run_config(cfg: HttpServer, args, send_tokens: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """All sessions of one configuration at once; see the module docstring."""
    import aiohttp

    url = f"{cfg.base_url}/chat/completions"
    ttft: dict[int, list[float]] = {t: [] for t in range(1, args.turns + 1)}
    done_tokens = 0
    finished = 0
    errors: list[str] = []

    async def session(http: Any, sid: int) -> None:
        nonlocal done_tokens, finished
        messages = first_messages(sid)
        tokens = 0
        for turn in range(1, args.turns + 1):
            body = {
                "model": cfg.model,
                "messages": messages,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }
            try:
                text, fields, n, first = await _turn(http, url, body)
            except Exception as exc:  # noqa: BLE001 - counted: a rollout that did not finish
                errors.append(f"session {sid} turn {turn}: {type(exc).__name__}: {exc}"[:300])
                return
            tokens += n
            ttft[turn].append(first)
            if send_tokens and not all(k in fields for k in TOKEN_FIELDS):
                errors.append(f"session {sid} turn {turn}: the answer carried no token fields")
                return
            messages = [
                *messages,
                {"role": "assistant", "content": text, **(fields if send_tokens else {})},
                {"role": "user", "content": tool_result(sid, turn)},
            ]
        done_tokens += tokens
        finished += 1

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=args.sessions)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(http, s) for s in range(args.sessions)))
        wall = time.perf_counter() - t0
    return {
        "config": cfg.name,
        "finished": finished,
        "sessions": args.sessions,
        "tokens": done_tokens,
        "seconds": wall,
        "tok_s": done_tokens / wall if wall > 0 else float("nan"),
        "ttft_s": {t: statistics.median(v) if v else float("nan") for t, v in ttft.items()},
        "errors": errors[:5],
    }


# ---------------------------------------------------------------------------------- the run
def run(args) -> dict[str, Any]:
    from gymserve.engine.gguf_store import resolve_gguf_model
    from gymserve.engine.model_store import embedded_gguf, embedded_model_dir

    gguf = Path(args.gguf) if args.gguf else embedded_gguf()
    resolve_gguf_model(str(gguf))  # fail early when the tokenizer beside it is missing
    threads = args.threads or os.cpu_count() or 1
    info = common.machine()
    starters: list[tuple[str, Any, bool, dict[str, Any]]] = [
        ("gymserve llamacpp", lambda: llamacpp_peers.start_gymserve_llamacpp(gguf, threads, HttpServer), True, {})
    ]
    if args.llama_server:
        exe = Path(args.llama_server)
        starters.append(
            (
                "llama-server",
                lambda: llamacpp_peers.start_llama_server(exe, gguf, threads, HttpServer, slots=args.sessions),
                False,
                {"cache_prompt": True},
            )
        )
    if not args.no_transformers:
        starters.append(("gymserve transformers", lambda: start_gymserve(embedded_model_dir(), threads), True, {}))
    rows: dict[str, list[dict[str, Any]]] = {}
    rounds: list[dict[str, Any]] = []
    notes: list[str] = []
    # One server at a time: two models loaded at once would share the two cores while one idles.
    for r in range(args.rounds):
        watch = common.LoadWatch()
        for name, start, send_tokens, extra in starters:
            print(f"[round {r + 1}/{args.rounds}] {name}: starting", file=sys.stderr, flush=True)
            try:
                cfg = start()
            except Exception as exc:  # noqa: BLE001 - one failing configuration should not hide the others
                notes.append(f"{name}: failed to start: {exc}"[:1000])
                print(notes[-1], file=sys.stderr)
                continue
            try:
                asyncio.run(_warm(cfg))
                res = asyncio.run(run_config(cfg, args, send_tokens, extra))
            finally:
                cfg.close()
            rows.setdefault(name, []).append(res)
            print(
                f"  {name}: {res['tok_s']:.2f} tok/s of finished rollouts ({res['finished']}/{res['sessions']} "
                f"finished, {res['seconds']:.1f} s); TTFT per turn {_ttft_text(res)}; errors {res['errors']}",
                file=sys.stderr,
                flush=True,
            )
        rounds.append(watch.end())
        print(f"  round {r + 1}: {common.steady_text(rounds[-1])}", file=sys.stderr, flush=True)
    return {
        "machine": info,
        "gguf": gguf.name,
        "sessions": args.sessions,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "threads": threads,
        "quick": args.quick,
        "rows": {name: max(rs, key=lambda x: x["tok_s"]) for name, rs in rows.items()},  # best round
        "all_rounds": rows,
        "rounds": rounds,
        "notes": notes,
    }


async def _warm(cfg: HttpServer) -> None:
    """One short call, so a model's first-use costs are not counted."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        body = {"model": cfg.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        async with http.post(f"{cfg.base_url}/chat/completions", json=body) as r:
            await r.read()


def _ttft_text(row: dict[str, Any]) -> str:
    return " / ".join(f"{v:.2f} s" for v in row["ttft_s"].values())


def report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    anchor = rows.get("llama-server")
    out = [
        common.machine_line(
            res["machine"],
            workload=f"{res['sessions']} sessions × {res['turns']} turns, ~120-token tool result per turn, greedy, "
            f"{res['max_tokens']} tokens per turn, GGUF {res['gguf']}, {res['threads']} threads",
            mode="quick" if res["quick"] else "full",
        )
    ]
    table_rows = []
    for name, r in rows.items():
        table_rows.append(
            [
                name,
                r["tok_s"],
                r["tok_s"] / anchor["tok_s"] if anchor else float("nan"),
                r["seconds"],
                f"{r['finished']}/{r['sessions']}",
                *[r["ttft_s"].get(t, r["ttft_s"].get(str(t), float("nan"))) for t in range(1, res["turns"] + 1)],
            ]
        )
    out.append(
        common.table(
            [
                "configuration",
                "tok/s (finished rollouts)",
                "÷ llama-server",
                "wall s",
                "finished",
                *[f"TTFT turn {t} s" for t in range(1, res["turns"] + 1)],
            ],
            table_rows,
            "Multi-turn rollouts (best round; TTFT: median over sessions)",
        )
    )
    out.append("")
    for i, w in enumerate(res["rounds"], 1):
        out.append(f"round {i}: {common.steady_text(w)}")
    for n in res["notes"]:
        out.append(f"note: {n}")
    gl = rows.get("gymserve llamacpp")
    out.append("\nTargets:")
    if gl and anchor:
        ratio = gl["tok_s"] / anchor["tok_s"]
        out.append(
            f"  {common.verdict(ratio >= TARGET)}  gymserve llamacpp ÷ llama-server, tokens/s of finished rollouts: "
            f"{ratio:.2f}× (target ≥ {TARGET}×)"
        )
    else:
        out.append(f"  n/a   gymserve llamacpp ÷ llama-server (target ≥ {TARGET}×): run with --llama-server PATH")
    if any(not w["steady"] for w in res["rounds"]):
        out.append("  NOTE  a round was NOT steady: these numbers are from a loaded machine")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 sessions, 16 tokens per turn")
    p.add_argument("--sessions", type=int, help="concurrent sessions (default 8; quick 2)")
    p.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    p.add_argument("--max-tokens", type=int, help="new tokens per turn (default 32; quick 16)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1); the best is reported")
    p.add_argument("--gguf", help="GGUF file (default: the embedded model's)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (the anchor; skipped without it)")
    p.add_argument("--no-transformers", action="store_true", help="skip gymserve on the transformers engine")
    p.add_argument("--threads", type=int, help="threads for every configuration (default: nproc)")
    args = p.parse_args(argv)
    args.sessions = args.sessions or (2 if args.quick else 8)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    res = run(args)
    common.save_results("multiturn-quick" if args.quick else "multiturn", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
