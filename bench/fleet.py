"""Replica routing on a simulated fleet: prefix-cache hits, throughput, tail latency and failed
rollouts per routing policy, with one replica killed and one slowed part way; then the router's
own cost as the fleet grows to hundreds of replicas and thousands of sessions.

What runs is gymserve's real chat backend — ``RemoteBackend`` → ``UpstreamCaller`` (retries, the
retry budget) → ``ReplicaPool`` (the policy, sessions, circuit breakers, health probes) — against
simulated engine replicas (``fleet_model.SimReplica``: continuous batching, chunked prefill that
shares each step with decoding, a bounded LRU prefix cache) on a virtual-time event loop, so a
run is deterministic for a seed and unaffected by the machine's load. The wiring over real HTTP
is what ``tests/backends/test_caller.py`` and ``tests/server/test_faults.py`` cover.

Workload (multi-turn agent rollouts, as an RL trainer sends them): ``--sessions`` rollouts in
flight at once, each ``turns`` turns; a turn's prompt is the previous prompt + its generation +
a tool result (gymserve keeps them token-contiguous, so the previous turn is a prefix), every
prompt starting with the same system prompt; between turns the tool runs. A finished rollout is
replaced by a new one. At 35% of the run one replica is killed (its calls fail with a reset
connection, new ones are refused); at 55% another becomes ``--slow-factor`` times slower. Every
policy gets the same rollouts (same seeds).

Reported per policy: the engines' prefix-cache hit rate (cached prompt tokens / prompt tokens, as
vLLM's ``prefix_cache_hits / prefix_cache_queries``) and the router's estimate of it; generated
tokens per simulated second after a 10% warm-up and its ratio to round-robin; p50/p99 turn latency;
failed rollouts (a turn that failed after retries); retries; sessions moved; and load balance:
the busiest replica's calls ÷ the mean over the replicas alive at the end. Goals (issue 18), for
the default ``sticky-least-loaded``: hit rate ≥ 90%, throughput ≥ 1.5× round-robin, no failed
rollout, no replica above 1.3× the mean load.

Router cost (``router_cost``): the real ``ReplicaPool`` alone, on ``N`` replicas with ``8 N`` sessions
in steady state (new sessions replacing finished ones, ``4 N`` calls in flight): CPU microseconds
per ``pick`` + ``release`` (``time.thread_time``: preemption by other processes is not counted).

Usage: ``python bench/fleet.py [--quick] [--replicas 8] [--sessions 64] [--duration 900]
[--seed 0] [--scale 8,64,256,1024] [--rebalance-ratio R] [--rebalance-min-gap G]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from fleet_model import EngineModel, SimReplica, VirtualTimeLoop, sim_backend  # noqa: E402
from gymserve.backends.base import RequestContext  # noqa: E402
from gymserve.config import ChatBackendConfig  # noqa: E402
from gymserve.errors import GymserveError  # noqa: E402

POLICIES = ("round-robin", "consistent-hash", "sticky-least-loaded")
DEFAULT = "sticky-least-loaded"


@dataclass
class Workload:
    """The rollouts and the failures of one run (simulated seconds and tokens; ranges are uniform)."""

    replicas: int = 8
    sessions: int = 64
    duration: float = 900.0
    turns: tuple[int, int] = (8, 16)
    task_tokens: tuple[int, int] = (300, 800)  # the rollout's own first prompt after the system prompt
    gen_tokens: tuple[int, int] = (50, 250)
    tool_tokens: tuple[int, int] = (200, 800)  # a tool result appended to the next prompt
    tool_s: tuple[float, float] = (0.5, 3.0)
    kill_at: float | None = 0.35  # fraction of the run; None: no failure
    slow_at: float | None = 0.55
    slow_factor: float = 3.0
    seed: int = 0


def run_policy(policy: str, wl: Workload, model: EngineModel, routing: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of ``wl`` routed by ``policy`` (``routing``: other ``RoutingConfig`` options) on a
    fresh virtual-time loop; returns its numbers."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(_run(policy, wl, model, routing or {}))
    finally:
        loop.close()


async def _run(policy: str, wl: Workload, model: EngineModel, routing: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    replicas = [SimReplica(f"replica-{i}", model) for i in range(wl.replicas)]
    for r in replicas:
        r.start()
    config = ChatBackendConfig.model_validate(
        {
            "type": "chat",
            "base_urls": [f"http://replica-{i}.sim:8000/v1" for i in range(wl.replicas)],
            "model": "sim",
            "timeout": 600,
            "num_concurrent_requests": 1 << 16,
            "health_check_interval": 5,
            "routing": {**routing, "policy": policy},
        }
    )
    backend = sim_backend(config, replicas)
    pool = backend.pool
    warmup = 0.1 * wl.duration
    latencies: list[float] = []
    failed: list[str] = []
    done = {"rollouts": 0, "tokens": 0, "prompt": 0, "new": 0}

    async def rollout(sid: str, rng: random.Random) -> None:
        new = rng.randint(*wl.task_tokens)  # what no cache can hold: the tokens this prompt adds
        prompt = model.system_prompt + new
        for _ in range(rng.randint(*wl.turns)):
            gen = rng.randint(*wl.gen_tokens)
            t0 = loop.time()
            try:
                await backend.chat(
                    {
                        "model": "sim",
                        "messages": [{"role": "user", "content": "…"}],
                        "max_tokens": gen,
                        "sim_prompt_tokens": prompt,
                    },
                    RequestContext(session_id=sid),
                )
            except GymserveError as exc:
                failed.append(f"{sid}: {exc.message[:120]}")
                return
            t1 = loop.time()
            latencies.append(t1 - t0)
            done["prompt"] += prompt
            done["new"] += new
            if t1 >= warmup:
                done["tokens"] += gen
            new = rng.randint(*wl.tool_tokens)
            prompt += gen + new
            await asyncio.sleep(rng.uniform(*wl.tool_s))
        done["rollouts"] += 1

    async def slot(i: int) -> None:
        await asyncio.sleep(random.Random(f"{wl.seed}-start-{i}").uniform(0, 5))
        k = 0
        while loop.time() < wl.duration:
            await rollout(f"rollout-{i}-{k}", random.Random(f"{wl.seed}-{i}-{k}"))
            k += 1

    async def chaos() -> None:
        if wl.kill_at is not None and wl.replicas > 1:
            await asyncio.sleep(wl.kill_at * wl.duration)
            replicas[1].kill()
        if wl.slow_at is not None and wl.replicas > 2:
            await asyncio.sleep(max(0.0, wl.slow_at * wl.duration - loop.time()))
            replicas[2].slow = wl.slow_factor

    tasks = [loop.create_task(slot(i)) for i in range(wl.sessions)] + [loop.create_task(chaos())]
    await asyncio.sleep(wl.duration)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    status = pool.status()
    await backend.close()
    for r in replicas:
        await r.stop()

    prompt = sum(r.counters.prompt_tokens for r in replicas)
    hit = sum(r.counters.hit_tokens for r in replicas)
    est_prompt = sum(row["prompt_tokens"] for row in status["replicas"])
    est_hit = sum(row["estimated_cached_tokens"] for row in status["replicas"])
    alive = [r for r in replicas if r is not replicas[1] or wl.kill_at is None]
    calls = [r.counters.calls for r in alive]
    queue = [r.counters.queue_area / wl.duration for r in alive]
    lat = sorted(latencies)
    return {
        "policy": policy,
        "hit_rate": hit / prompt if prompt else 0.0,
        "hit_ceiling": 1 - done["new"] / done["prompt"] if done["prompt"] else 0.0,
        "router_estimate": est_hit / est_prompt if est_prompt else 0.0,
        "tok_s": done["tokens"] / (wl.duration - warmup),
        "p50_s": common.percentile(lat, 50),
        "p99_s": common.percentile(lat, 99),
        "turns": len(lat),
        "rollouts": done["rollouts"],
        "failed_rollouts": len(failed),
        "failures": failed[:5],
        "retries": status["retry_budget"]["retries"],
        "retries_denied": status["retry_budget"]["denied"],
        "session_moves": pool.sessions.moves,
        "max_load_ratio": max(calls) / statistics.mean(calls),
        "max_queue_ratio": max(queue) / statistics.mean(queue) if statistics.mean(queue) else 0.0,
        "calls_per_replica": [r.counters.calls for r in replicas],
        "evictions": sum(r.counters.evicted for r in replicas),
    }


def router_cost(policy: str, replicas: int, calls: int, seed: int, repeat: int = 3) -> dict[str, Any]:
    """CPU per call of ``ReplicaPool.pick`` + ``release`` on ``replicas`` replicas with ``8 ×``
    as many sessions in steady state: each session makes 8-16 calls, then a new one takes its place
    (its first call is a placement); ``4 ×`` replicas calls are in flight, so loads differ and no
    scan stops early at an idle replica. The call sequence is drawn before the clock starts; the
    garbage collector is off while it runs; best of ``repeat`` (each on a fresh pool)."""
    import gc
    from collections import deque

    from gymserve.backends.pool import Outcome, Replica, ReplicaPool
    from gymserve.config import RoutingConfig

    rng = random.Random(seed)
    live = [f"s{i}" for i in range(8 * replicas)]
    left = [rng.randint(8, 16) for _ in live]
    fresh = len(live)
    sequence: list[str] = []
    for _ in range(calls):
        i = rng.randrange(len(live))
        sequence.append(live[i])
        left[i] -= 1
        if left[i] == 0:
            live[i], left[i], fresh = f"s{fresh}", rng.randint(8, 16), fresh + 1
    best = float("inf")
    for _ in range(repeat):
        pool = ReplicaPool(
            [Replica(f"http://replica-{i}.sim:8000/v1") for i in range(replicas)],
            interval=0,
            routing=RoutingConfig(policy=policy),
        )
        held: deque = deque()
        window = 4 * replicas
        gc.collect()
        gc.disable()
        try:
            t0 = time.thread_time()
            for sid in sequence:
                held.append((pool.pick(sid), sid))
                if len(held) > window:
                    r, done = held.popleft()
                    pool.release(r, Outcome.OK, session_id=done, usage=(6000, 150))
            best = min(best, time.thread_time() - t0)
        finally:
            gc.enable()
    return {
        "replicas": replicas,
        "sessions": 8 * replicas,
        "policy": policy,
        "calls": calls,
        "placements": fresh,
        "router_us_per_call": 1e6 * best / calls,
    }


def scale(sizes: list[int], calls: int, seed: int) -> list[dict[str, Any]]:
    """``router_cost`` of every policy at every fleet size."""
    rows = []
    for n in sizes:
        for policy in POLICIES:
            row = router_cost(policy, n, calls, seed)
            rows.append(row)
            print(
                f"  router {n:5d} replicas {8 * n:6d} sessions {policy:<20}: {row['router_us_per_call']:6.1f} µs per call",
                flush=True,
            )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = EngineModel()
    wl = Workload(replicas=args.replicas, sessions=args.sessions, duration=args.duration, seed=args.seed)
    rows = []
    routing = {
        k: v
        for k, v in (("rebalance_ratio", args.rebalance_ratio), ("rebalance_min_gap", args.rebalance_min_gap))
        if v is not None
    }
    for policy in POLICIES:
        t0 = time.perf_counter()
        res = run_policy(policy, wl, model, routing)
        res["wall_s"] = time.perf_counter() - t0
        rows.append(res)
        print(
            f"  {policy:<20} hit {100 * res['hit_rate']:5.1f}%  {res['tok_s']:8.1f} tok/s  p99 {res['p99_s']:6.1f} s  "
            f"failed {res['failed_rollouts']}  ({res['wall_s']:.1f} s)",
            flush=True,
        )
    sizes = (
        [int(x) for x in args.scale.split(",")] if args.scale else ([8, 64, 256] if args.quick else [8, 64, 256, 1024])
    )
    return {
        "machine": common.machine(),
        "quick": args.quick,
        "workload": asdict(wl),
        "routing": routing,
        "model": asdict(model),
        "rows": rows,
        "scale": scale(sizes, 20_000 if args.quick else 50_000, args.seed),
    }


def report(res: dict[str, Any]) -> str:
    wl, m = res["workload"], res["model"]
    rows = {r["policy"]: r for r in res["rows"]}
    base = rows["round-robin"]["tok_s"]
    table = common.table(
        [
            "policy",
            "prefix hit (engine)",
            "÷ ceiling",
            "router's estimate",
            "tokens/s",
            "÷ round-robin",
            "p50 s",
            "p99 s",
            "failed rollouts",
            "rollouts",
            "retries",
            "sessions moved",
            "max ÷ mean calls",
        ],
        [
            [
                r["policy"],
                f"{100 * r['hit_rate']:.1f}%",
                f"{r['hit_rate'] / r['hit_ceiling']:.2f}",
                f"{100 * r['router_estimate']:.1f}%",
                f"{r['tok_s']:.0f}",
                f"{r['tok_s'] / base:.2f}",
                f"{r['p50_s']:.1f}",
                f"{r['p99_s']:.1f}",
                r["failed_rollouts"],
                r["rollouts"],
                r["retries"],
                r["session_moves"],
                f"{r['max_load_ratio']:.2f}",
            ]
            for r in res["rows"]
        ],
        f"{wl['replicas']} replicas, {wl['sessions']} concurrent rollouts, {wl['duration']:.0f} simulated s; "
        f"replica-1 killed at {100 * wl['kill_at']:.0f}%, replica-2 {wl['slow_factor']:g}x slower from "
        f"{100 * wl['slow_at']:.0f}%",
    )
    by = {}
    for r in res["scale"]:
        by.setdefault((r["replicas"], r["sessions"]), {})[r["policy"]] = r
    scale_rows = [
        [
            n,
            s,
            *(f"{by[(n, s)][p]['router_us_per_call']:.1f}" for p in POLICIES),
            f"{by[(n, s)][DEFAULT]['calls']:,} ({by[(n, s)][DEFAULT]['placements']:,})",
        ]
        for (n, s) in by
    ]
    scale_table = common.table(
        ["replicas", "sessions", *(f"{p} µs/call" for p in POLICIES), "calls (of them new sessions)"],
        scale_rows,
        "Router cost: CPU time of ReplicaPool.pick + release per call, steady state, GC off (best of 3)",
    )
    d = rows[DEFAULT]
    small, large = by[min(by)][DEFAULT]["router_us_per_call"], by[max(by)][DEFAULT]["router_us_per_call"]
    lines = [
        common.machine_line(
            res["machine"],
            mode="quick" if res["quick"] else "full",
            seed=wl["seed"],
            engine=(
                f"decode {1000 * m['decode_step_s']:g} ms/step, prefill {m['prefill_tok_s']:g} tok/s in "
                f"{m['chunk_tokens']}-token chunks, batch <= {m['max_batch']}, cache {m['cache_tokens']:,} tokens"
            ),
            rollouts=(
                f"system prompt {m['system_prompt']} + task {wl['task_tokens'][0]}-{wl['task_tokens'][1]} tokens, "
                f"{wl['turns'][0]}-{wl['turns'][1]} turns of {wl['gen_tokens'][0]}-{wl['gen_tokens'][1]} generated + "
                f"{wl['tool_tokens'][0]}-{wl['tool_tokens'][1]} tool tokens, tools {wl['tool_s'][0]}-{wl['tool_s'][1]} s"
            ),
        ),
        table,
        "",
        scale_table,
        "",
        "Targets (sticky-least-loaded, the default)",
        f"  {common.verdict(d['hit_rate'] >= 0.9)}  prefix-cache hit rate {100 * d['hit_rate']:.1f}% (target >= 90%; "
        f"the workload's ceiling, every turn's new tokens uncached: {100 * d['hit_ceiling']:.1f}%)",
        f"  {common.verdict(d['tok_s'] >= 1.5 * base)}  throughput {d['tok_s'] / base:.2f}x round-robin (target >= 1.5x)",
        f"  {common.verdict(d['failed_rollouts'] == 0)}  failed rollouts with a replica killed: {d['failed_rollouts']} "
        f"(target 0; {d['retries']} calls retried)",
        f"  {common.verdict(d['max_load_ratio'] <= 1.3)}  busiest replica {d['max_load_ratio']:.2f}x the mean calls "
        "(target <= 1.3x)",
        f"  n/a   router cost {small:.1f} µs per call at {min(by)[0]} replicas, {large:.1f} µs at {max(by)[0]} "
        f"({max(by)[1]} sessions)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("gymserve").setLevel(logging.ERROR)  # the router's warnings, hundreds per run
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a shorter run and smaller fleets (seconds)")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=64, help="rollouts in flight at once")
    ap.add_argument("--duration", type=float, default=None, help="simulated seconds (900; 300 quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rebalance-ratio", type=float, help="routing.rebalance_ratio (default: the config's)")
    ap.add_argument("--rebalance-min-gap", type=int, help="routing.rebalance_min_gap (default: the config's)")
    ap.add_argument("--scale", help="comma-separated fleet sizes for the router cost (8,64,256,1024; quick 8,64,256)")
    args = ap.parse_args(argv)
    if args.duration is None:
        args.duration = 300.0 if args.quick else 900.0
    res = run(args)
    common.save_results("fleet-quick" if args.quick else "fleet", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
