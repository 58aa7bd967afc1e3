"""Soak test: many concurrent multi-turn sessions through ``gymserve serve`` against a fast fake
chat backend, on loopback; checks zero errors, flat memory, and reports latency percentiles and
the server's CPU per 1,000 requests.

    python bench/load.py                        # 500 sessions, 10 s warm-up + 60 s measured
    python bench/load.py --sessions 50 --duration 10 --warmup 3     # a quick look

Each session is a rollout: ``--turns`` Responses calls with the same ``X-Session-ID``, each sending
the whole history so far (user message, then the previous turns' function calls and outputs), as
an agent would; then it starts a new session. Bounded in time (``--warmup`` + ``--duration``, plus
a hard deadline) and in count (``--max-requests``). Everything binds 127.0.0.1.

Memory: the gymserve process's resident set size is sampled right after warm-up and at the end;
the run passes when the end is within ``--rss-tolerance`` (10 %) of the warm-up value, there were
no errors, and (reported, not enforced) server CPU per 1,000 requests. The numbers of a shared
2-core machine are noisy: the load client, the fake upstream and gymserve all compete for the same
cores, so latency here is an upper bound, not gymserve's own cost.

Output: a table on stdout and JSON (``--json PATH``). Exit code 0 on pass, 1 on fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_seconds, free_port, gymserve_cmd, percentile, rss_mib, start_child, start_fake_chat, wait_http  # noqa: E402

HARD_DEADLINE_SLACK = 60.0  # seconds past warm-up + duration after which everything is abandoned


def _turn_body(session: int, turn: int, history: list[dict]) -> dict:
    return {
        "model": "fake",
        "input": history,
        "max_output_tokens": 64,
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            }
        ],
        "metadata": {"session": str(session), "turn": str(turn)},
    }


async def _session_loop(
    client, url: str, sid: int, turns: int, stats: dict, stop_at: float, measure_from: float, max_requests: int
) -> None:
    import aiohttp

    n = 0
    while time.monotonic() < stop_at:
        session = f"load-{sid}-{n}"
        n += 1
        history: list[dict] = [{"role": "user", "content": f"Session {session}: what is the weather in Paris?"}]
        for turn in range(turns):
            if time.monotonic() >= stop_at or stats["sent"] >= max_requests:
                return
            stats["sent"] += 1
            t0 = time.monotonic()
            try:
                async with client.post(
                    url, json=_turn_body(sid, turn, history), headers={"X-Session-ID": session}
                ) as r:
                    body = await r.read()
                    status = r.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                status, body = -1, f"{type(exc).__name__}: {exc}".encode()
            took = time.monotonic() - t0
            measured = t0 >= measure_from
            if status != 200:
                stats["errors"] += 1
                stats["first_error"] = stats["first_error"] or f"{status}: {body[:300]!r}"
                break
            if measured:
                stats["latencies"].append(took)
            stats["ok"] += 1
            out = json.loads(body)["output"]
            calls = [o for o in out if o.get("type") == "function_call"]
            history = (
                history
                + out
                + [
                    {
                        "type": "function_call_output",
                        "call_id": c["call_id"],
                        "output": json.dumps({"city": "Paris", "temperature_c": 21 + turn}),
                    }
                    for c in calls
                ]
            )
            if not calls:
                history.append({"role": "user", "content": "And tomorrow?"})


async def _drive(base: str, args, server_pid: int) -> dict:
    import aiohttp

    stats = {"sent": 0, "ok": 0, "errors": 0, "first_error": None, "latencies": []}
    start = time.monotonic()
    measure_from = start + args.warmup
    stop_at = measure_from + args.duration
    connector = aiohttp.TCPConnector(limit=args.sessions, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        url = base + "/v1/responses"
        tasks = [
            asyncio.create_task(
                _session_loop(client, url, i, args.turns, stats, stop_at, measure_from, args.max_requests)
            )
            for i in range(args.sessions)
        ]
        await asyncio.sleep(max(0.0, measure_from - time.monotonic()))
        rss_warm = rss_mib(server_pid, children=False)
        cpu_warm = cpu_seconds(server_pid, children=False)
        ok_warm = stats["ok"]
        t_warm = time.monotonic()
        rss_peak = rss_warm
        while time.monotonic() < stop_at and not all(t.done() for t in tasks):
            await asyncio.sleep(1.0)
            rss_peak = max(rss_peak, rss_mib(server_pid, children=False))
        done, pending = await asyncio.wait(tasks, timeout=args.request_timeout + 5)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:
                stats["errors"] += 1
                stats["first_error"] = stats["first_error"] or repr(t.exception())[:300]
        elapsed = time.monotonic() - t_warm
        rss_end = rss_mib(server_pid, children=False)
        cpu_end = cpu_seconds(server_pid, children=False)
    measured_ok = stats["ok"] - ok_warm
    lat = stats["latencies"]
    return {
        "sessions": args.sessions,
        "turns_per_session": args.turns,
        "warmup_s": args.warmup,
        "duration_s": round(elapsed, 1),
        "requests_ok": stats["ok"],
        "requests_measured": measured_ok,
        "errors": stats["errors"],
        "first_error": stats["first_error"],
        "throughput_rps": round(measured_ok / elapsed, 1) if elapsed else None,
        "latency_ms": {q: round(percentile(lat, p) * 1000, 1) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
        | {"max": round(max(lat) * 1000, 1) if lat else None},
        "server_rss_mib": {"after_warmup": round(rss_warm, 1), "end": round(rss_end, 1), "peak": round(rss_peak, 1)},
        "rss_growth_pct": round((rss_end - rss_warm) / rss_warm * 100, 2) if rss_warm else None,
        "server_cpu_s_per_1000_requests": round((cpu_end - cpu_warm) / measured_ok * 1000, 3) if measured_ok else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=500, help="concurrent sessions (default 500)")
    p.add_argument("--turns", type=int, default=4, help="turns per session before a new one starts")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds (default 60)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring (default 10)")
    p.add_argument("--max-requests", type=int, default=2_000_000, help="stop after this many requests")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--rss-tolerance", type=float, default=10.0, help="allowed RSS growth after warm-up, %%")
    p.add_argument("--delay-ms", type=float, default=0.0, help="the fake upstream's delay per answer")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.duration <= 0 or args.turns < 1:
        p.error("--sessions, --turns and --duration must be positive")

    fake = start_fake_chat(delay_ms=args.delay_ms)
    port = free_port()
    server = start_child(
        "gymserve-load",
        gymserve_cmd(
            "serve",
            "--base-url",
            f"http://127.0.0.1:{fake.port}/v1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            "fake",
        ),
        port,
    )
    try:
        wait_http(server, f"http://127.0.0.1:{port}/health", 60)
        hard = args.warmup + args.duration + args.request_timeout + HARD_DEADLINE_SLACK
        result = asyncio.run(asyncio.wait_for(_drive(f"http://127.0.0.1:{port}", args, server.pid), hard))
    finally:
        server.stop()
        fake.stop()
    ok = (
        result["errors"] == 0
        and result["requests_measured"] > 0
        and result["rss_growth_pct"] is not None
        and result["rss_growth_pct"] <= args.rss_tolerance
    )
    result["pass"] = ok
    lat = result["latency_ms"]
    print(
        f"gymserve load: {result['sessions']} sessions x {result['turns_per_session']} turns, "
        f"{result['duration_s']} s measured after {result['warmup_s']} s warm-up (loopback, shared cores)"
    )
    print(
        f"  requests ok {result['requests_ok']} (measured {result['requests_measured']}), errors {result['errors']}"
        + (f" (first: {result['first_error']})" if result["first_error"] else "")
    )
    print(
        f"  throughput {result['throughput_rps']} req/s; latency p50 {lat['p50']} ms, p90 {lat['p90']} ms, "
        f"p99 {lat['p99']} ms, max {lat['max']} ms"
    )
    rss = result["server_rss_mib"]
    print(
        f"  server RSS {rss['after_warmup']} MiB after warm-up -> {rss['end']} MiB at end "
        f"({result['rss_growth_pct']:+.2f} %, peak {rss['peak']} MiB); "
        f"server CPU {result['server_cpu_s_per_1000_requests']} s per 1,000 requests"
    )
    print("  PASS" if ok else "  FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
