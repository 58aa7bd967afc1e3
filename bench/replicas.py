"""Aggregate throughput of 1 vs 2 Ray replicas of the same model on this machine.

The same workload (``--sessions`` concurrent sessions × ``--turns`` turns × ``--max-tokens``
generated tokens, each turn sent back with its token fields as a trainer does) through three
backends, every engine with the same ``--cpus-per-replica`` CPUs and torch threads (default 1)
and the same batch limit (``--max-batch-size``, default 8, so the default 16 sessions saturate
one engine — the situation a second replica is for):

- ``local``: the ``LocalBackend`` in this process (no Ray: the reference);
- ``ray x1``: one replica behind ``RayBackend``;
- ``ray x2``: two replicas behind ``RayBackend``.

All three stay up and the rounds alternate between them (``--repeat``, default 3), keeping each
one's best round, so load from other processes that comes and goes hits all of them alike.
Printed: the core count and load average, tokens/s per round, and the ratios ``ray x2 / ray x1``
(what a second replica buys on this machine) and ``ray x1 / local`` (what Ray routing costs;
1.00 is nothing). Equal per-engine resources keep the comparison about replicas, not about torch's
thread scaling (a 2-thread engine on 2 busy cores loses far more to contention than two 1-thread
engines). Two 1-CPU replicas need two idle cores to double throughput; on a shared 2-core machine
expect less — that contention is the machine's, not the router's.

Default model: a random-weight Qwen2 (hidden 384, 6 layers) with the embedded model's tokenizer,
written once to the gymserve cache — big enough that generation, not HTTP or Ray, dominates.
``--model embedded`` uses the real 0.5B model (slow on CPU: ~5 tokens/s per core pair).

Usage: ``python bench/replicas.py [--sessions 16 --turns 2 --max-tokens 32 --cpus-per-replica 1 --repeat 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path


def bench_model_dir() -> Path:
    """A random-weight Qwen2 with the embedded model's tokenizer and chat template (cached)."""
    from gymserve.engine.model_store import cache_dir, embedded_model_dir

    out = cache_dir() / "bench" / "Qwen2-random-384x6"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    embedded = embedded_model_dir()
    real = json.loads((embedded / "config.json").read_text())
    cfg = Qwen2Config(
        vocab_size=real["vocab_size"],
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    Qwen2ForCausalLM(cfg).save_pretrained(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, tmp / name)
    tmp.rename(out)
    return out


async def workload(backend, sessions: int, turns: int, max_tokens: int, tag: str) -> tuple[int, float]:
    """Run the sessions concurrently; returns (generated tokens, seconds)."""
    from gymserve.backends.base import RequestContext

    async def one(i: int) -> int:
        messages = [{"role": "user", "content": f"Session {i}: tell me a long story."}]
        tokens = 0
        for turn in range(turns):
            ctx = RequestContext(session_id=f"{tag}-{i}")
            out = await backend.chat({"model": "m", "messages": messages, "max_tokens": max_tokens}, ctx)
            msg = out["choices"][0]["message"]
            tokens += out["usage"]["completion_tokens"]
            messages = messages + [
                {
                    "role": "assistant",
                    "content": msg["content"],
                    **{k: msg[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")},
                },
                {"role": "user", "content": f"Continue (turn {turn + 2})."},
            ]
        return tokens

    await asyncio.gather(*(one(i) for i in range(min(2, sessions))))  # warm-up: first-call costs
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(sessions)))
    return sum(counts), time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory or 'embedded' (default: a cached random-weight Qwen2)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8, help="per engine (default 8: 16 sessions saturate one)")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cpus-per-replica", type=int, default=1, help="CPUs and torch threads per engine (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds; the best round of each counts")
    args = ap.parse_args()

    import ray

    from gymserve.backends.local import LocalBackend
    from gymserve.config import LocalBackendConfig, RayBackendConfig
    from gymserve.ray_cluster.backend import RayBackend
    from gymserve.ray_cluster.fleet import connect_ray

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per = args.cpus_per_replica
    model = args.model or str(bench_model_dir())
    local = {"model": model, "max_model_len": 2048, "max_num_seqs": args.max_batch_size}
    print(
        f"machine: {cores} cores ({os.cpu_count()} logical), load average {os.getloadavg()[0]:.1f}; model {model}",
        flush=True,
    )
    print(
        f"workload: {args.sessions} concurrent sessions x {args.turns} turns x {args.max_tokens} tokens; per engine "
        f"{per} CPU/thread, batch <= {args.max_batch_size}; best of {args.repeat} alternating rounds",
        flush=True,
    )

    base = {
        "type": "ray",
        "ray_address": "local",
        "object_store_memory": 100 * 1024 * 1024,
        "health_check_interval": 5,
        "startup_timeout": 600,
        "replica_resources": {"num_cpus": per},
        **local,
    }
    # Both fleets (1 and 2 replicas) stay up for the whole run so rounds can alternate without
    # restarts; Ray is told it has enough logical CPUs for all three replicas, though only one
    # fleet works at a time (the other's replicas sit idle).
    connect_ray(RayBackendConfig.model_validate(base), num_cpus=3 * per)
    best: dict[str, float] = {}

    async def run() -> None:
        fleets = {"local": LocalBackend.from_config(LocalBackendConfig(**local, num_threads=per))}
        for n in (1, 2):
            fleets[f"ray x{n}"] = RayBackend.from_config(RayBackendConfig.model_validate({**base, "replicas": n}))
        try:
            for rnd in range(args.repeat):
                for name, backend in fleets.items():
                    n, secs = await workload(backend, args.sessions, args.turns, args.max_tokens, f"{name}-{rnd}")
                    best[name] = max(best.get(name, 0.0), n / secs)
                    print(
                        f"  round {rnd + 1}  {name:<7}: {n:5d} tokens in {secs:6.2f} s = {n / secs:7.1f} tok/s",
                        flush=True,
                    )
        finally:
            for backend in fleets.values():
                await backend.close()

    try:
        asyncio.run(run())
    finally:
        ray.shutdown()

    print("best:", ", ".join(f"{k} {v:.1f} tok/s" for k, v in best.items()))
    print(
        f"ratio ray x2 / ray x1 = {best['ray x2'] / best['ray x1']:.2f}  "
        f"(on {cores} cores; load average now {os.getloadavg()[0]:.1f})"
    )
    print(f"ratio ray x1 / local  = {best['ray x1'] / best['local']:.2f}  (Ray routing overhead; 1.00 = none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
