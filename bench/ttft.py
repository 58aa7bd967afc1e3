"""Streaming latency of the local engine: time to first event vs a non-streamed call's total time.

Starts ``gymserve serve`` on the embedded model (greedy, its own process) and drives it with the
official openai SDK. For two requests — a short text answer, and a tool request the model answers
with a call (``qwen2_5_coder`` parser: the call is committed at ``{"name": ..., "arguments": {``
and its arguments stream) — it measures, in interleaved rounds so machine load hits both alike:

- ``total``: a non-streamed ``responses.create`` (the baseline);
- ``first event``: ``response.created`` of the same request streamed;
- ``first output``: the first ``response.output_text.delta`` (text) or
  ``response.function_call_arguments.delta`` (tool call);
- ``stream total``: the stream's ``response.completed``.

Printed: medians in seconds and the ratios to ``total`` from the same run (lower is better; the
token stream is the point: first output should come well before the non-streamed answer).

Usage: ``python bench/ttft.py [--quick] [--reps 5] [--max-tokens 48] [--model DIR]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
REQUESTS = {
    "text": {"input": "Explain in three sentences what a hash map is."},
    "tool call": {"input": "What is the weather in Paris right now? Use the tool.", "tools": TOOLS},
}
FIRST_OUTPUT = ("response.output_text.delta", "response.function_call_arguments.delta")


def start(model_dir: Path) -> common.Child:
    port = common.free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "backend": {"type": "local", "model": str(model_dir), "sampling": {"temperature": 0}},
    }
    path = Path(tempfile.gettempdir()) / f"gymserve-bench-ttft-{port}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    child = common.start_child("gymserve-ttft", common.gymserve_cmd("serve", "--config", str(path)), port)
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 600)
    return child


def one_round(client, body: dict, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    client.responses.create(model="embedded", max_output_tokens=max_tokens, **body)
    total = time.perf_counter() - t0
    out: dict[str, float] = {"total": total}
    t0 = time.perf_counter()
    with client.responses.stream(model="embedded", max_output_tokens=max_tokens, **body) as stream:
        for event in stream:
            now = time.perf_counter() - t0
            if event.type == "response.created":
                out.setdefault("first event", now)
            elif event.type in FIRST_OUTPUT:
                out.setdefault("first output", now)
                out.setdefault("first output kind", event.type)  # type: ignore[arg-type]
    out["stream total"] = time.perf_counter() - t0
    return out


def run(reps: int, max_tokens: int, model: Path | None, quick: bool) -> dict:
    from openai import OpenAI

    from gymserve.engine.model_store import embedded_model_dir

    child = start(model or embedded_model_dir())
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{child.port}/v1", api_key="unused", timeout=600)
        one_round(client, REQUESTS["text"], 4)  # warm-up: first-call allocations, template compile
        runs: dict[str, list[dict]] = {name: [] for name in REQUESTS}
        for _ in range(reps):
            for name, body in REQUESTS.items():
                runs[name].append(one_round(client, body, max_tokens))
    finally:
        child.stop()
    rows = []
    for name, rounds in runs.items():
        med = {
            k: statistics.median(r[k] for r in rounds if k in r)
            for k in ("total", "first event", "first output", "stream total")
            if any(k in r for r in rounds)
        }
        rows.append(
            {"request": name, **med, "first output kind": sorted({r.get("first output kind") or "-" for r in rounds})}
        )
    return {"machine": common.machine(), "quick": quick, "reps": reps, "max_tokens": max_tokens, "rows": rows}


def report(res: dict) -> str:
    rows = []
    for r in res["rows"]:
        first = r.get("first output", float("nan"))
        rows.append(
            [
                r["request"],
                common.fmt(r["total"]),
                common.fmt(r["first event"], 3),
                common.fmt(r["first event"] / r["total"], 3),
                common.fmt(first),
                common.fmt(first / r["total"]),
                common.fmt(r["stream total"] / r["total"]),
                ", ".join(r["first output kind"]),
            ]
        )
    text = next(r for r in res["rows"] if r["request"] == "text")
    ok = text["first event"] / text["total"] < 0.1 and text.get("first output", 1e9) / text["total"] < 0.5
    return "\n".join(
        [
            common.machine_line(
                res["machine"], reps=res["reps"], max_tokens=res["max_tokens"], mode="quick" if res["quick"] else "full"
            ),
            common.table(
                [
                    "request",
                    "total s",
                    "first event s",
                    "ratio",
                    "first output s",
                    "ratio",
                    "stream/total",
                    "first output event",
                ],
                rows,
                "Local engine streaming latency (medians; ratios to the non-streamed total)",
            ),
            "\nTargets",
            f"  {common.verdict(ok)}  text: first event before 0.1 and first text delta before 0.5 of the "
            "non-streamed total",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=None, help="rounds (5; 2 quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (48; 24 quick)")
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run(
        args.reps or (2 if args.quick else 5), args.max_tokens or (24 if args.quick else 48), args.model, args.quick
    )
    common.save_results("ttft-quick" if args.quick else "ttft", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
