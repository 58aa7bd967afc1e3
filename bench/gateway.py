"""What the gateway costs: gymserve's Responses endpoint in front of a fast fake chat backend.

One workload — multi-turn tool-calling Responses requests whose JSON bodies are ~1 KB, ~10 KB
and ~100 KB (a weather agent's history: function calls, tool outputs, assistant messages; shaped
so NeMo Gym's strict input validation accepts it too) — sent at concurrency 1, 16 and 64:

- ``direct``: the equivalent Chat Completions request (gymserve's own ``responses_to_chat`` of the
  same body, computed once up front) straight to the fake backend — the baseline;
- ``gymserve``: ``POST /v1/responses`` to ``gymserve serve --backend chat`` (its own process);
- ``gymserve-messages``: the same conversation as an Anthropic Messages request, ``POST /v1/messages``
  to the same gymserve (``messages_request``);
- ``nemo-gym``: ``POST /v1/responses`` to NeMo Gym 0.7.0's ``vllm_model`` server (the peer, its
  own process, ``.venv-nemo``, built on first use by ``bench/common.py``).

The fake backend (``bench/fake_chat_server.py``) answers every chat request with the same tool
call in its own process. The load client is aiohttp (an httpx client caps near 180 req/s here),
with pre-serialized bodies. Reported per cell: requests/s, p50/p99 latency, and the CPU seconds
the measured server process (gymserve, NeMo Gym, or for ``direct`` the fake) spent per 1,000
requests; ratios against ``direct`` and gymserve/peer, all from one run.

Targets (10 KB history; issue #30): added p50 latency over direct ≤ 0.5 ms at concurrency 1; gymserve
CPU ≤ 0.3 s per 1,000 requests; at concurrency 32 (or the highest measured up to 32) ≥ 0.25 of the
direct rate; throughput at concurrency 64 ≥ 5× the peer's.

Usage: ``python bench/gateway.py [--quick] [--no-peer] [--sizes 1,10,100] [--concurrency 1,16,64]
[--rounds 1] [--variant NAME=CMD] [--profile]``. ``--rounds N`` measures every cell N times, the
targets interleaved, and reports the medians (on a loaded machine the server's CPU seconds per request
is the number to read: rates and latencies move with the load). ``--variant`` adds another gymserve
build to the same run, e.g. ``before='env PYTHONPATH=/tmp/before/src python -m gymserve.cli'`` for a
before/after comparison. ``--profile`` samples gymserve with py-spy during a 10 KB, concurrency-16 load and
prints its hot spots (nothing else is measured).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": False,
    }
]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo", "Dublin", "Athens"]


def _turn(i: int, pad: int) -> list[dict[str, Any]]:
    """One agent turn: the model's function call, the tool's output (``pad`` bytes of report), the
    model's answer, the user's next question."""
    city = CITIES[i % len(CITIES)]
    report = {
        "city": city,
        "temperature_c": 10 + i % 17,
        "conditions": "partly cloudy",
        "wind_kph": 5 + i % 30,
        "humidity": 40 + i % 50,
        "forecast": ("Mild with a light breeze; clouds clearing towards evening. " * 40)[: max(0, pad)],
    }
    return [
        {
            "type": "function_call",
            "id": f"fc_{i:06d}",
            "call_id": f"call_{i:06d}",
            "name": "get_weather",
            "arguments": json.dumps({"city": city}),
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": f"call_{i:06d}", "output": json.dumps(report)},
        {
            "type": "message",
            "id": f"msg_{i:06d}",
            "role": "assistant",
            "status": "completed",
            "content": [
                {
                    "type": "output_text",
                    "text": f"In {city} it is {report['temperature_c']} °C and partly cloudy.",
                    "annotations": [],
                }
            ],
        },
        {"type": "message", "role": "user", "content": f"And what about {CITIES[(i + 1) % len(CITIES)]}?"},
    ]


def responses_request(target_bytes: int, model: str = "fake") -> dict[str, Any]:
    """A Responses create request whose JSON body is ``target_bytes`` long, give or take 5%."""
    req: dict[str, Any] = {
        "model": model,
        "instructions": "You are a weather assistant. Use the get_weather tool.",
        "input": [{"type": "message", "role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS,
        "max_output_tokens": 64,
        "temperature": 1.0,
    }
    size = lambda: len(json.dumps(req).encode())  # noqa: E731
    i = 0
    while size() < target_bytes * 0.95:
        room = target_bytes - size()
        base = len(json.dumps(_turn(i, 0)).encode()) + 4
        pad = min(700, room - base)
        if pad < 0:
            if i == 0:  # always at least one tool-calling turn
                req["input"] += _turn(i, 0)
            break
        req["input"] += _turn(i, pad)
        i += 1
    return req


def messages_request(resp_req: dict[str, Any]) -> dict[str, Any]:
    """The same conversation as ``resp_req`` as an Anthropic Messages create request: instructions →
    ``system``, function calls → ``tool_use`` blocks of the assistant turn, their outputs →
    ``tool_result`` blocks of the next user turn."""
    messages: list[dict[str, Any]] = []

    def add(role: str, block: dict[str, Any]) -> None:
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].append(block)
        else:
            messages.append({"role": role, "content": [block]})

    for item in resp_req["input"]:
        if item["type"] == "function_call":
            add(
                "assistant",
                {
                    "type": "tool_use",
                    "id": item["call_id"],
                    "name": item["name"],
                    "input": json.loads(item["arguments"]),
                },
            )
        elif item["type"] == "function_call_output":
            add("user", {"type": "tool_result", "tool_use_id": item["call_id"], "content": item["output"]})
        elif item["role"] == "assistant":
            add("assistant", {"type": "text", "text": "".join(p["text"] for p in item["content"])})
        else:
            add("user", {"type": "text", "text": item["content"]})
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in resp_req["tools"]
    ]
    return {
        "model": resp_req["model"],
        "system": resp_req["instructions"],
        "messages": messages,
        "tools": tools,
        "max_tokens": resp_req["max_output_tokens"],
        "temperature": resp_req["temperature"],
    }


def chat_request(resp_req: dict[str, Any]) -> dict[str, Any]:
    """The Chat Completions request gymserve's chat backend sends for ``resp_req``."""
    from gymserve.convert import ConvertOptions, responses_to_chat

    return responses_to_chat(
        resp_req,
        ConvertOptions(reasoning_mode="reasoning_content", developer_role="system", max_tokens_field="max_tokens"),
    )


# ---------------------------------------------------------------------------------- servers
def start_gymserve(upstream: str, name: str = "gymserve", cmd: list[str] | None = None) -> common.Child:
    """``gymserve serve --backend chat`` in its own process; ``cmd`` replaces ``python -m gymserve.cli``
    (``--variant``: the same arguments follow it)."""
    port = common.free_port()
    args = [
        "serve",
        "--backend",
        "chat",
        "--base-url",
        upstream,
        "--model",
        "fake",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    child = common.start_child(name, (cmd + args) if cmd else common.gymserve_cmd(*args), port)
    common.wait_http(child, f"http://127.0.0.1:{port}/health", 60)
    return child


def start_nemo(upstream: str, install: bool) -> common.Child | None:
    app = common.nemo_venv(install=install)
    if app is None:
        return None
    py = common.ROOT / ".venv-nemo" / "bin" / "python"
    port, head = common.free_port(), common.free_port()
    opts = "++policy_model.responses_api_models.vllm_model."
    cmd = [
        str(py),
        "app.py",
        f"+config_paths=[{app / 'configs' / 'vllm_model.yaml'}]",
        f"++policy_base_url={upstream}",
        "++policy_api_key=dummy",
        "++policy_model_name=fake",
        f"{opts}return_token_id_information=false",
        f"{opts}uses_reasoning_parser=false",
        f"{opts}host=127.0.0.1",
        f"{opts}port={port}",
        "++head_server.host=127.0.0.1",
        f"++head_server.port={head}",
    ]
    child = common.start_child(
        "nemo-gym", cmd, port, cwd=str(app), env={"NEMO_GYM_CONFIG_PATH": "policy_model", "PYTHONWARNINGS": "ignore"}
    )
    probe = json.dumps(responses_request(1000)).encode()
    common.wait_http(child, f"http://127.0.0.1:{port}/v1/responses", 180, method="POST", body=probe)
    return child


# ---------------------------------------------------------------------------------- load
async def measure(
    url: str, body: bytes, *, concurrency: int, requests: int, time_limit: float, pid: int, warmup: int = 20
) -> dict[str, Any]:
    """One cell: warm up, then ``requests`` POSTs of ``body`` at ``concurrency``; CPU of ``pid``."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"content-type": "application/json", "authorization": "Bearer dummy"}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one(_i: int) -> None:
            async with s.post(url, data=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")

        await common.run_load(one, requests=max(warmup, concurrency), concurrency=concurrency, time_limit=10)
        cpu0 = common.cpu_seconds(pid)
        res = await common.run_load(one, requests=requests, concurrency=concurrency, time_limit=time_limit)
        cpu = common.cpu_seconds(pid) - cpu0
    if res.n == 0:
        raise RuntimeError(f"no request to {url} succeeded: {res.first_error}")
    return {
        "n": res.n,
        "errors": res.errors,
        "rps": res.rps,
        "p50_ms": res.p(50) * 1e3,
        "p99_ms": res.p(99) * 1e3,
        "cpu_s_per_1k": cpu / res.n * 1000,
        "first_error": res.first_error,
    }


def run(args) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    n_c1, n_cx, t_lim = (150, 400, 4.0) if args.quick else (1500, 4000, 30.0)
    info = common.machine()
    fake = common.start_fake_chat()
    upstream = f"http://127.0.0.1:{fake.port}/v1"
    children = [fake]
    try:
        gs = start_gymserve(upstream)
        children.append(gs)
        targets = {
            "direct": (f"{upstream}/chat/completions", fake.pid),
            "gymserve": (f"http://127.0.0.1:{gs.port}/v1/responses", gs.pid),
            "gymserve-messages": (f"http://127.0.0.1:{gs.port}/v1/messages", gs.pid),
        }
        for spec in args.variant or []:
            vname, _, vcmd = spec.partition("=")
            v = start_gymserve(upstream, vname, vcmd.split())
            children.append(v)
            targets[vname] = (f"http://127.0.0.1:{v.port}/v1/responses", v.pid)
        peer_note = None
        if not args.no_peer:
            try:
                nemo = start_nemo(upstream, install=not args.no_install)
            except Exception as exc:  # noqa: BLE001 - the rest of the table is still worth having
                nemo, peer_note = None, f"NeMo Gym did not start: {exc}"[:2000]
            if nemo is not None:
                children.append(nemo)
                targets["nemo-gym"] = (f"http://127.0.0.1:{nemo.port}/v1/responses", nemo.pid)
            else:
                peer_note = peer_note or "NeMo Gym is not installed (.venv-nemo); run without --no-install"
            if peer_note:
                print(peer_note, file=sys.stderr)
        rows = []
        for kb in sizes:
            req = responses_request(kb * 1024)
            bodies = {
                "direct": json.dumps(chat_request(req)).encode(),
                "gymserve": json.dumps(req).encode(),
                "gymserve-messages": json.dumps(messages_request(req)).encode(),
            }
            for c in concs:
                n = n_c1 if c == 1 else n_cx
                cells: dict[str, list[dict[str, Any]]] = {}
                for r in range(args.rounds):  # interleaved: a change in the machine's load hits every target
                    for name, (url, pid) in targets.items():
                        cell = asyncio.run(
                            measure(
                                url,
                                bodies.get(name, bodies["gymserve"]),
                                concurrency=c,
                                requests=n,
                                time_limit=t_lim,
                                pid=pid,
                            )
                        )
                        cells.setdefault(name, []).append(cell)
                        print(
                            f"  {kb:>3} KB c={c:<3} {name:<17} {cell['rps']:8.0f} req/s  p50 {cell['p50_ms']:7.2f} ms  "
                            f"p99 {cell['p99_ms']:7.2f} ms  cpu {cell['cpu_s_per_1k']:6.2f} s/1k  (n={cell['n']}, "
                            f"errors={cell['errors']}, round {r + 1}/{args.rounds})",
                            file=sys.stderr,
                            flush=True,
                        )
                for name, got in cells.items():
                    cell = _median_cell(got)
                    cell.update(target=name, kb=kb, body_bytes=len(bodies.get(name, bodies["gymserve"])), concurrency=c)
                    rows.append(cell)
        rss = {ch.name: round(common.rss_mib(ch.pid), 1) for ch in children if ch.alive()}
    finally:
        for ch in reversed(children):
            ch.stop()
    return {
        "machine": info,
        "client": f"aiohttp {_version('aiohttp')}, one process, pre-serialized bodies",
        "quick": args.quick,
        "rows": rows,
        "rss_mib": rss,
        "peer_note": peer_note,
        "gymserve_version": _version("gymserve"),
        "nemo_gym_version": "0.7.0" if "nemo-gym" in rss else None,
    }


def _median_cell(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from ``--rounds`` measurements of it: the median of each number (requests and errors
    summed); CPU per request is the robust one on a loaded machine, rates and latencies move with it."""
    import statistics

    out = {k: statistics.median(c[k] for c in cells) for k in ("rps", "p50_ms", "p99_ms", "cpu_s_per_1k")}
    out.update(
        n=sum(c["n"] for c in cells),
        errors=sum(c["errors"] for c in cells),
        rounds=len(cells),
        first_error=next((c["first_error"] for c in cells if c["first_error"]), None),
    )
    return out


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _cell(rows, target, kb, c):
    for r in rows:
        if r["target"] == target and r["kb"] == kb and r["concurrency"] == c:
            return r
    return None


def report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    out = [
        common.machine_line(
            res["machine"],
            client=res["client"],
            upstream="bench/fake_chat_server.py (own process)",
            mode="quick" if res["quick"] else "full",
        )
    ]
    table_rows = []
    for r in rows:
        d = _cell(rows, "direct", r["kb"], r["concurrency"])
        peer = _cell(rows, "nemo-gym", r["kb"], r["concurrency"])
        added = r["p50_ms"] - d["p50_ms"] if d else float("nan")
        vs_peer = r["rps"] / peer["rps"] if peer and r["target"] not in ("direct", "nemo-gym") else float("nan")
        table_rows.append(
            [
                f"{r['kb']} KB",
                r["concurrency"],
                r["target"],
                r["rps"],
                r["p50_ms"],
                r["p99_ms"],
                added if r["target"] != "direct" else float("nan"),
                r["rps"] / d["rps"] if d else float("nan"),
                vs_peer,
                r["cpu_s_per_1k"],
            ]
        )
    out.append(
        common.table(
            [
                "history",
                "conc.",
                "server",
                "req/s",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "req/s ÷ direct",
                "req/s ÷ peer",
                "server CPU s/1k req",
            ],
            table_rows,
            "Responses (and Messages) gateway over a fake chat backend (CPU: the measured server process; "
            "for 'direct' the fake itself)",
        )
    )
    out.append(f"\nRSS at the end (MiB): {res['rss_mib']}")
    if res.get("peer_note"):
        out.append(f"peer: {res['peer_note']}")
    out.append("\nTargets (10 KB history):")
    for line in targets(res):
        out.append("  " + line)
    return "\n".join(out)


def targets(res: dict[str, Any]) -> list[str]:
    rows = res["rows"]
    lines = []
    g1, d1 = _cell(rows, "gymserve", 10, 1), _cell(rows, "direct", 10, 1)
    if g1 and d1:
        added = g1["p50_ms"] - d1["p50_ms"]
        lines.append(f"{common.verdict(added <= 0.5)}  added p50 at concurrency 1: {added:.2f} ms (target ≤ 0.5 ms)")
    gcpu = [r["cpu_s_per_1k"] for r in rows if r["target"] == "gymserve" and r["kb"] == 10]
    if gcpu:
        lines.append(
            f"{common.verdict(max(gcpu) <= 0.3)}  gymserve CPU per 1,000 requests: worst {max(gcpu):.2f} s, "
            f"best {min(gcpu):.2f} s (target ≤ 0.3 s)"
        )
    many = max((r["concurrency"] for r in rows if r["concurrency"] <= 32), default=None)
    gm, dm = _cell(rows, "gymserve", 10, many), _cell(rows, "direct", 10, many)
    if many and many > 1 and gm and dm:
        share = gm["rps"] / dm["rps"]
        lines.append(
            f"{common.verdict(share >= 0.25)}  req/s at concurrency {many}: {share:.3f} of direct (target ≥ 0.25)"
        )
    watch = res["machine"].get("run_watch")
    if watch is not None and not watch["steady"]:
        lines.append(f"NOTE  the run was {common.steady_text(watch)}: rates and latencies are loaded numbers")
    g64, p64 = _cell(rows, "gymserve", 10, 64), _cell(rows, "nemo-gym", 10, 64)
    if g64 and p64:
        ratio = g64["rps"] / p64["rps"]
        lines.append(
            f"{common.verdict(ratio >= 5)}  throughput at concurrency 64: {ratio:.1f}× the peer's "
            f"({g64['rps']:.0f} vs {p64['rps']:.0f} req/s; target ≥ 5×)"
        )
    elif g64:
        lines.append("n/a   throughput vs peer: the peer was not measured")
    for c in sorted({r["concurrency"] for r in rows}):
        g, m = _cell(rows, "gymserve", 10, c), _cell(rows, "gymserve-messages", 10, c)
        if g and m:
            lines.append(
                f"info  /v1/messages ÷ /v1/responses at concurrency {c}: CPU per request "
                f"{m['cpu_s_per_1k'] / g['cpu_s_per_1k']:.2f}×, req/s {m['rps'] / g['rps']:.2f}×"
            )
    return lines


# ---------------------------------------------------------------------------------- profiling
def profile(args) -> None:
    """py-spy samples gymserve under the 10 KB, concurrency-16 load. ``--gil``: only samples where the
    thread holds the GIL, i.e. Python work; a thread preempted inside a socket ``write`` (which the
    woken upstream causes on a busy 2-core machine) would otherwise look like 20-30% "CPU"."""
    fake = common.start_fake_chat()
    upstream = f"http://127.0.0.1:{fake.port}/v1"
    if args.variant:  # profile the first variant instead (e.g. a patched build)
        vname, _, vcmd = args.variant[0].partition("=")
        gs = start_gymserve(upstream, vname, vcmd.split())
    else:
        gs = start_gymserve(upstream)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "gymserve-bench" / f"{gs.name}-profile.txt"
    try:
        body = json.dumps(responses_request(10 * 1024)).encode()
        url = f"http://127.0.0.1:{gs.port}/v1/responses"
        asyncio.run(measure(url, body, concurrency=16, requests=200, time_limit=5, pid=gs.pid))
        duration = 6 if args.quick else 20
        spy = subprocess.Popen(
            [
                "py-spy",
                "record",
                "-p",
                str(gs.pid),
                "-d",
                str(duration),
                "-r",
                "200",
                "-f",
                "raw",
                "-o",
                str(out),
                "--nonblocking",
                "--gil",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1)
        asyncio.run(measure(url, body, concurrency=16, requests=100000, time_limit=duration + 2, pid=gs.pid, warmup=0))
        spy.wait(60)
        if spy.returncode:
            raise RuntimeError(f"py-spy failed: {spy.stderr.read().decode(errors='replace')[-500:]}")
    finally:
        gs.stop()
        fake.stop()
    print(hot_spots(out))


def hot_spots(path: Path, top: int = 25) -> str:
    """Self and total % per function from py-spy's collapsed stacks (``a;b;c count`` lines)."""
    self_c: collections.Counter = collections.Counter()
    total_c: collections.Counter = collections.Counter()
    n = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        frames = [
            f.split(" (")[0]
            + " ("
            + f.split(" (")[1].split(":")[0].split("site-packages/")[-1].split("/src/")[-1]
            + ")"
            if " (" in f
            else f
            for f in stack.split(";")
        ]
        n += k
        self_c[frames[-1]] += k
        for f in set(frames):
            total_c[f] += k
    lines = [
        f"py-spy: {n} samples of gymserve under the 10 KB, concurrency-16 gateway load ({path})",
        "\nTop by self time:",
    ]
    lines += [f"  {c / n * 100:5.1f}%  {f}" for f, c in self_c.most_common(top)]
    lines.append("\nBy layer (a sample counts for the innermost layer it is in):")
    for layer, c in _layers(path).most_common():
        lines.append(f"  {c / n * 100:5.1f}%  {layer}")
    lines.append("\nTop by total (inclusive) time:")
    lines += [f"  {c / n * 100:5.1f}%  {f}" for f, c in total_c.most_common(top + 15)]
    return "\n".join(lines)


_LAYERS = [  # (layer, path fragments); decisive layers first
    ("gymserve convert (responses_to_chat / chat_to_response)", ("gymserve/convert/",)),
    ("gymserve chat backend + protocol (incl. copy.deepcopy)", ("gymserve/backends/", "gymserve/protocol.py")),
    ("gymserve server (body read + orjson parse/dump, context)", ("gymserve/server/",)),
    ("openai SDK client (request options, stdlib json encode/decode)", ("openai/",)),
    ("httpx / httpcore client transport", ("httpx", "httpcore")),
    ("uvicorn / starlette / fastapi server", ("uvicorn/", "starlette/", "fastapi/")),
]
_AMBIGUOUS = (
    ("h11 (HTTP/1.1 parser)", ("h11/",)),
    ("stdlib json", ("json/",)),
    ("anyio / sniffio", ("anyio/", "sniffio/")),
    ("asyncio event loop + sockets", ("asyncio/", "selectors.py")),
)


def _layers(path: Path) -> collections.Counter:
    """Samples per layer: the innermost frame that belongs to a decisive layer decides (so h11 or
    asyncio work done for the upstream client counts as client transport); otherwise the innermost
    ambiguous one."""
    out: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        layer = fallback = None
        for frame in reversed(stack.split(";")):
            layer = next((name for name, frags in _LAYERS if any(f in frame for f in frags)), None)
            if layer:
                break
            fallback = fallback or next((name for name, frags in _AMBIGUOUS if any(f in frame for f in frags)), None)
        out[layer or fallback or "other"] += int(count)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few hundred requests per cell (seconds)")
    p.add_argument("--sizes", default="1,10,100", help="history sizes in KB (default 1,10,100)")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--no-peer", action="store_true", help="skip NeMo Gym")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds per cell, the median reported (default 1)")
    p.add_argument("--no-install", action="store_true", help="never build .venv-nemo (skip the peer if absent)")
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME=CMD",
        help="also measure another gymserve build: CMD (e.g. '/tmp/venv/bin/python -m gymserve.cli') is "
        "followed by the serve arguments; for before/after comparisons in one run",
    )
    p.add_argument("--profile", action="store_true", help="py-spy hot spots of gymserve under the 10 KB load")
    args = p.parse_args(argv)
    if args.profile:
        profile(args)
        return 0
    res = run(args)
    if not args.quick:
        common.save_results("gateway", res)
    else:
        common.save_results("gateway-quick", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
