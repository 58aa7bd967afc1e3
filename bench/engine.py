"""Token-exact local engine throughput: gymserve vs raw ``model.generate`` vs ``transformers serve``.

The embedded model (Qwen2.5-Coder-0.5B-Instruct, safetensors copy, fp32 on CPU), greedy decoding,
``--max-tokens`` new tokens (48; 16 with ``--quick``), at 1 stream and 8 concurrent streams:

- ``raw generate``: ``model.generate`` in this process — the ceiling; 8 streams are one batch of 8
  left-padded prompts;
- ``gymserve``: ``gymserve serve`` (local backend, its own process, ``sampling.temperature: 0``)
  over HTTP, driven by the official openai SDK's ``AsyncOpenAI``;
- ``transformers serve`` and ``transformers serve --continuous-batching``: the peer, same model
  directory, from ``.venv-peer`` (built on first use by ``bench/common.py``: torch pinned and installed first),
  same client.

Every configuration gets the same torch thread count (``nproc``), prompts that ask for long code
answers, and tokens are counted as generated (``usage.completion_tokens``; for raw generate up to
and including the first EOS), so an early stop cannot inflate a rate. All configurations are loaded
first (~11 GB together), then measured in interleaved rounds (each at 1 stream, then each at 8
streams; ``--reps`` rounds), so a change in the machine's load hits all of them alike. Printed:
tokens/s, p50/p95 request latency, ratios against raw generate from the same run, and the targets:

- 1 stream: gymserve ≥ 0.9× raw generate;
- 8 streams: gymserve ≥ 2× its own 1-stream throughput, and ≥ 1.0× the peer's best configuration.

Usage: ``python bench/engine.py [--quick] [--max-tokens 48] [--reps 2] [--no-peer] [--no-install]
[--model DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TASKS = [
    "parses a CSV file of sales records and returns the total revenue per region",
    "implements an LRU cache class with get and put methods",
    "computes the shortest path in a weighted graph with Dijkstra's algorithm",
    "validates an email address with a regular expression and explains each part",
    "merges two sorted linked lists into one sorted list",
    "downloads a web page with urllib and counts the words in it",
    "converts a Roman numeral string to an integer and back",
    "implements binary search over a sorted list, iteratively and recursively",
]


def messages(i: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f"Write a Python function that {TASKS[i % len(TASKS)]}. "
            "Include type hints, a docstring, comments and an example.",
        }
    ]


def _summary(name: str, streams: int, tokens: int, latencies: list[float], wall: float) -> dict[str, Any]:
    return {
        "config": name,
        "streams": streams,
        "tokens": tokens,
        "seconds": wall,
        "tok_s": tokens / wall if wall > 0 else float("nan"),
        "p50_s": common.percentile(latencies, 50),
        "p95_s": common.percentile(latencies, 95),
    }


# ---------------------------------------------------------------------------------- raw generate
class RawGenerate:
    """``model.generate`` in this process: one prompt, or the 8 prompts as one left-padded batch."""

    name = "raw generate"

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = {self.tok.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])}
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.texts = [
            self.tok.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False) for i in range(8)
        ]

    def generate(self, batch: list[str], n: int) -> tuple[int, float]:
        enc = self.tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad,
                top_p=None,
                top_k=None,
                temperature=None,
            )
        dt = time.perf_counter() - t0
        count = 0
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            for t in row:
                count += 1
                if t in self.eos:
                    break
        return count, dt

    def one(self, n: int) -> tuple[int, list[float], float]:
        count, dt = self.generate(self.texts[:1], n)
        return count, [dt], dt

    def eight(self, n: int) -> tuple[int, list[float], float]:
        count, dt = self.generate(self.texts, n)
        return count, [dt] * 8, dt

    def rss(self) -> float:
        import psutil

        return psutil.Process().memory_info().rss / 2**20

    def close(self) -> None:
        del self.model
        gc.collect()


# ---------------------------------------------------------------------------------- HTTP servers
class HttpServer:
    """A chat server in its own process, driven by ``AsyncOpenAI`` (non-streaming, temperature 0)."""

    def __init__(self, name: str, child: common.Child, model: str):
        self.name, self.child, self.model = name, child, model
        self.base_url = f"http://127.0.0.1:{child.port}/v1"

    async def _run(self, idx: list[int], n: int) -> tuple[int, list[float], float]:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=1800)

        async def one(i: int) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(
                model=self.model, messages=messages(i), max_tokens=n, temperature=0
            )
            return r.usage.completion_tokens, time.perf_counter() - t0

        try:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(i) for i in idx))
            return sum(c for c, _ in res), [dt for _, dt in res], time.perf_counter() - t0
        finally:
            await client.close()

    def one(self, n: int):
        return asyncio.run(self._run([0], n))

    def eight(self, n: int):
        return asyncio.run(self._run(list(range(8)), n))

    def rss(self) -> float:
        return common.rss_mib(self.child.pid)

    def close(self) -> None:
        self.child.stop()


def start_gymserve(model_dir: Path, threads: int) -> HttpServer:
    port = common.free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "backend": {
            "type": "local",
            "model": str(model_dir),
            "max_batch_size": 8,
            "num_threads": threads,
            "sampling": {"temperature": 0},
        },
    }
    path = Path(tempfile.gettempdir()) / f"gymserve-bench-engine-{port}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    child = common.start_child(
        "gymserve-local",
        common.gymserve_cmd("serve", "--config", str(path)),
        port,
        env={"OMP_NUM_THREADS": str(threads)},
    )
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 600)
    return HttpServer("gymserve", child, "embedded")


def start_peer(model_dir: Path, threads: int, cb: bool, install: bool) -> HttpServer | None:
    exe = common.peer_venv(install=install)
    if exe is None:
        return None
    port = common.free_port()
    cmd = [str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    name = "transformers serve"
    if cb:
        # KV cache capped at 20% of free memory (its default is 60%): 8 short sequences need far
        # less, and other processes share this machine.
        cmd += ["--continuous-batching", "--cb-max-memory-percent", "0.2"]
        name += " --continuous-batching"
    child = common.start_child(
        "transformers-serve" + ("-cb" if cb else ""),
        cmd,
        port,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)},
    )
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 600)
    return HttpServer(name, child, str(model_dir))


# ---------------------------------------------------------------------------------- the run
def run(args) -> dict[str, Any]:
    """All configurations loaded at once, then measured in interleaved rounds (1 stream for each,
    then 8 streams for each), so a change in the machine's load hits all of them alike."""
    import psutil

    from gymserve.engine.model_store import embedded_model_dir

    model_dir = Path(args.model) if args.model else embedded_model_dir()
    threads = os.cpu_count() or 1
    max_tokens = args.max_tokens or (16 if args.quick else 48)
    rounds = args.reps or (1 if args.quick else 2)
    info = common.machine()
    starters = [
        ("raw generate", lambda: RawGenerate(model_dir, threads)),
        ("gymserve", lambda: start_gymserve(model_dir, threads)),
    ]
    if not args.no_peer:
        starters += [
            ("transformers serve", lambda: start_peer(model_dir, threads, False, not args.no_install)),
            (
                "transformers serve --continuous-batching",
                lambda: start_peer(model_dir, threads, True, not args.no_install),
            ),
        ]
    notes, configs = [], []
    try:
        for name, start in starters:
            avail = psutil.virtual_memory().available / 2**30
            if avail < 4 and configs:
                notes.append(f"{name}: skipped, only {avail:.1f} GiB of memory available")
                continue
            print(f"[start] {name}", file=sys.stderr, flush=True)
            try:
                cfg = start()
            except Exception as exc:  # noqa: BLE001 - a failing peer should not hide the others
                notes.append(f"{name}: failed to start: {exc}"[:1500])
                print(notes[-1], file=sys.stderr)
                continue
            if cfg is None:
                notes.append(f"{name}: not installed (.venv-peer); run without --no-install")
                continue
            configs.append(cfg)
        for cfg in configs:  # warm-up
            cfg.one(2)
        acc: dict[tuple[str, int], list] = {}
        for r in range(rounds):
            for streams, method in ((1, "one"), (8, "eight")):
                for cfg in configs:
                    tokens, lat, wall = getattr(cfg, method)(max_tokens)
                    a = acc.setdefault((cfg.name, streams), [0, [], 0.0])
                    a[0] += tokens
                    a[1] += lat
                    a[2] += wall
                    print(
                        f"  round {r + 1}/{rounds} {cfg.name:<42} {streams} stream(s): {tokens / wall:6.2f} tok/s "
                        f"({tokens} tokens in {wall:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
        rss = {cfg.name: round(cfg.rss()) for cfg in configs}
    finally:
        for cfg in reversed(configs):
            cfg.close()
    rows = [_summary(name, streams, *a) for (name, streams), a in acc.items()]
    rows.sort(key=lambda r: (r["streams"], [c.name for c in configs].index(r["config"])))
    return {
        "machine": info,
        "model": model_dir.name,
        "max_tokens": max_tokens,
        "reps": rounds,
        "threads": threads,
        "client": "openai AsyncOpenAI (servers); in-process model.generate (raw)",
        "quick": args.quick,
        "rows": rows,
        "rss_mib": rss,
        "notes": notes,
    }


def _get(rows, config, streams):
    return next((r for r in rows if r["config"] == config and r["streams"] == streams), None)


def report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    out = [
        common.machine_line(
            res["machine"],
            model=f"{res['model']} fp32, greedy, {res['max_tokens']} new tokens, {res['threads']} torch threads",
            client=res["client"],
            mode="quick" if res["quick"] else "full",
        )
    ]
    table_rows = []
    for r in rows:
        raw = _get(rows, "raw generate", r["streams"])
        table_rows.append(
            [
                r["config"],
                r["streams"],
                r["tok_s"],
                r["tok_s"] / raw["tok_s"] if raw else float("nan"),
                r["p50_s"],
                r["p95_s"],
                r["tokens"],
                res["rss_mib"].get(r["config"], "-"),
            ]
        )
    out.append(
        common.table(
            ["configuration", "streams", "tokens/s", "÷ raw generate", "p50 s", "p95 s", "tokens", "RSS MiB"],
            table_rows,
            "Local engine throughput (8 streams: aggregate; raw generate = one left-padded batch)",
        )
    )
    for n in res["notes"]:
        out.append(f"note: {n}")
    out.append("\nTargets:")
    out += ["  " + line for line in targets(res)]
    return "\n".join(out)


def targets(res: dict[str, Any]) -> list[str]:
    rows = res["rows"]
    g1, g8, raw1 = _get(rows, "gymserve", 1), _get(rows, "gymserve", 8), _get(rows, "raw generate", 1)
    lines = []
    if g1 and raw1:
        r = g1["tok_s"] / raw1["tok_s"]
        lines.append(f"{common.verdict(r >= 0.9)}  1 stream: gymserve {r:.2f}× raw generate (target ≥ 0.9×)")
    if g1 and g8:
        r = g8["tok_s"] / g1["tok_s"]
        lines.append(f"{common.verdict(r >= 2)}  8 streams: {r:.2f}× gymserve's 1-stream throughput (target ≥ 2×)")
    peers = [r for r in rows if r["config"].startswith("transformers serve") and r["streams"] == 8]
    if g8 and peers:
        best = max(peers, key=lambda r: r["tok_s"])
        r = g8["tok_s"] / best["tok_s"]
        lines.append(
            f"{common.verdict(r >= 1.0)}  8 streams: {r:.2f}× the peer's best ({best['config']}) (target ≥ 1.0×)"
        )
    elif g8:
        lines.append("n/a   8 streams vs peer: the peer was not measured")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 new tokens, 1 round")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 48; quick 16)")
    p.add_argument("--reps", type=int, help="measurement rounds (default 2; quick 1)")
    p.add_argument("--model", help="model directory (default: the embedded model's safetensors copy)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers serve")
    p.add_argument("--no-install", action="store_true", help="never build .venv-peer (skip the peer if absent)")
    args = p.parse_args(argv)
    res = run(args)
    common.save_results("engine-quick" if args.quick else "engine", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
