"""Token-exact local engines against their ceilings and peers: transformers and llama.cpp.

The embedded model (Qwen2.5-Coder-0.5B-Instruct), greedy decoding, ``--max-tokens`` new tokens (48;
16 with ``--quick``), at 1 stream and 8 concurrent streams:

- ``raw generate``: ``model.generate`` in this process on the fp32 safetensors copy — the
  transformers ceiling; 8 streams are one batch of 8 left-padded prompts;
- ``gymserve transformers`` and ``gymserve llamacpp``: ``gymserve serve`` (local backend, its own
  process, ``sampling.temperature: 0``) with each CPU engine, over HTTP;
- ``transformers serve`` (with and without ``--continuous-batching``) on the safetensors copy, from
  ``.venv-peer`` (built on first use by ``bench/common.py``: torch pinned and installed first);
- ``llama-server -np 8`` (``--llama-server PATH``) and ``llama_cpp.server`` on the same GGUF file
  (``bench/llamacpp_peers.py``).

Servers are driven by the official openai SDK's ``AsyncOpenAI``. Every configuration gets the same
thread count (``nproc``) and prompts that ask for long code answers; tokens are counted as generated
(``usage.completion_tokens``; raw generate: up to the first EOS). All configurations are loaded
first, then measured in interleaved rounds (each at 1 stream, then each at 8 streams, then each
prefilling a ~1,000-token prompt that starts with a fresh nonce so no prompt cache helps;
``--reps`` rounds), so a change in the machine's load hits all of them alike. Printed: tokens/s,
p50/p95 request latency, prefill tokens/s, RSS, the fraction of the memory-bandwidth bound
(``llamacpp_peers``), ratios from the same run, the llamacpp engine's largest |generation-time −
teacher-forced| log-prob (1 and 8 streams), and the targets:

- gymserve transformers: ≥ 0.9× raw generate at 1 stream; ≥ 2× its own 1-stream rate at 8 streams;
  ≥ 1.0× the best ``transformers serve`` at 8 streams;
- gymserve llamacpp: ≥ 1.0× llama-server at 1 stream, at 8 streams and in prefill (issue #30;
  llama-server run with its own defaults, see below); ≥ 4× gymserve transformers at both; RSS ≤ 1.5 GB
  at 8 streams.

Each configuration runs with the environment the benchmark was started with — nothing set here for
all of them, so llama-server runs as its users run it (llama.cpp's default OpenMP wait policy) and
gymserve's llamacpp engine picks its own — and the table's *environment* column says what each ran
with. The machine line names the CPU's vector flags, the command, the load average at the start and
end; each round says whether it was steady (``common.LoadWatch``: load moved ≤ 1.0 and other
processes used ≤ 0.5 core); numbers from rounds that were not are marked as such.

Usage: ``python bench/engine.py [--quick] [--max-tokens 48] [--reps 2] [--no-peer] [--no-install]
[--model DIR] [--gguf FILE] [--llama-server PATH] [--no-transformers]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

# No environment is set here for every configuration (issue #30): each server runs with the
# environment this benchmark was started with (common.CALLER_ENV), as its users run it — llama-server
# with llama.cpp's default, spinning OpenMP threads, which on free cores is the faster policy — and
# gymserve's llamacpp engine picks its own (llamacpp_runtime.OMP_WAIT_POLICY, PASSIVE unless the
# environment names one). The table says which environment each configuration ran with.
ENV_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import llamacpp_peers  # noqa: E402
from gymserve.engine.llamacpp_runtime import OMP_WAIT_POLICY  # noqa: E402

# The configurations in this process (the raw llama.cpp loop: the llamacpp engine's ceiling; raw
# generate) wait the way the engine makes llama.cpp wait — set before anything loads an OpenMP runtime,
# which reads it once. The servers do not inherit it: they start from common.CALLER_ENV, the
# environment captured before this line.
os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
from engine_configs import (  # noqa: E402
    HttpServer,
    RawGenerate,
    messages,
    prefill_messages,
    start_gymserve,
    start_peer,
)


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


def _environment(cfg) -> str:
    """The OpenMP settings ``cfg`` ran with: its process's environment (``/proc/PID/environ``), or
    this process's for an in-process configuration; what gymserve's llamacpp engine sets for itself
    when the environment names no policy is said as such."""
    import psutil

    child = getattr(cfg, "child", None)
    if child is not None:
        try:
            env = psutil.Process(child.pid).environ()
        except psutil.Error:
            return "?"
        where = ""
    else:
        env, where = dict(os.environ), "this process: "
    parts = [f"{k}={env[k]}" for k in ENV_KEYS if k in env]
    if "OMP_WAIT_POLICY" not in env:
        if cfg.name == "gymserve llamacpp":
            parts.insert(0, "OMP_WAIT_POLICY=PASSIVE (set by the engine itself)")
        else:
            parts.insert(0, "no OMP_WAIT_POLICY (the program's default)")
    return where + ", ".join(parts)


# ---------------------------------------------------------------------------------- the run
def _starters(args, model_dir: Path, gguf: Path, threads: int) -> list[tuple[str, Any]]:
    from gymserve.engine.gguf_store import resolve_gguf_model

    install = not args.no_install
    starters: list[tuple[str, Any]] = []
    if not args.no_transformers:
        starters += [
            ("raw generate", lambda: RawGenerate(model_dir, threads)),
            ("gymserve transformers", lambda: start_gymserve(model_dir, threads)),
        ]
    tok_dir = resolve_gguf_model(str(gguf)).path
    starters.append(
        (
            "raw llama.cpp loop",
            lambda: llamacpp_peers.RawLlama(gguf, tok_dir, threads, messages, prefill_messages),
        )
    )
    starters.append(("gymserve llamacpp", lambda: llamacpp_peers.start_gymserve_llamacpp(gguf, threads, HttpServer)))
    if args.no_peer:
        return starters
    if args.llama_server:
        exe = Path(args.llama_server)
        starters.append(
            ("llama-server -np 8", lambda: llamacpp_peers.start_llama_server(exe, gguf, threads, HttpServer))
        )
    starters.append(
        ("llama_cpp.server", lambda: llamacpp_peers.start_llama_cpp_python_server(gguf, threads, HttpServer, install))
    )
    if not args.no_transformers:
        starters += [
            ("transformers serve", lambda: start_peer(model_dir, threads, False, install)),
            ("transformers serve --continuous-batching", lambda: start_peer(model_dir, threads, True, install)),
        ]
    return starters


def _start_all(starters, notes: list[str]) -> list:
    import psutil

    configs = []
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
            notes.append(f"{name}: not installed; run without --no-install")
            continue
        configs.append(cfg)
    return configs


def run(args) -> dict[str, Any]:
    """All configurations loaded at once, then measured in interleaved rounds (1 stream for each,
    then 8 streams for each, then a prefill for each), so a change in the machine's load hits all
    of them alike; then the llamacpp engine's log-prob gap, in this process."""
    from gymserve.engine.gguf_store import resolve_gguf_model
    from gymserve.engine.model_store import embedded_gguf, embedded_model_dir

    model_dir = Path(args.model) if args.model else embedded_model_dir()
    gguf = Path(args.gguf) if args.gguf else embedded_gguf()
    threads = args.threads or os.cpu_count() or 1
    max_tokens = args.max_tokens or (16 if args.quick else 48)
    rounds = args.reps or (1 if args.quick else 2)
    info = common.machine()
    notes: list[str] = []
    bandwidth = [llamacpp_peers.copy_bandwidth()]
    configs = _start_all(_starters(args, model_dir, gguf, threads), notes)
    acc: dict[tuple[str, int], list] = {}
    prefill: dict[str, list[float]] = {}
    round_watch: list[dict[str, Any]] = []
    environments = {cfg.name: _environment(cfg) for cfg in configs}
    try:
        for cfg in configs:  # warm-up
            cfg.one(2)
        for r in range(rounds):
            watch = common.LoadWatch()
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
            for cfg in configs:
                n, dt = cfg.prefill(f"round {r} {time.time_ns()}")
                prefill.setdefault(cfg.name, []).append(n / dt)
            bandwidth.append(llamacpp_peers.copy_bandwidth())
            round_watch.append(watch.end())
            print(f"  round {r + 1}/{rounds}: {common.steady_text(round_watch[-1])}", file=sys.stderr, flush=True)
        environments.update({cfg.name: _environment(cfg) for cfg in configs if cfg.name.startswith("raw")})
        rss = {cfg.name: round(cfg.rss()) for cfg in configs if cfg.rss() == cfg.rss()}  # NaN: not its own process
    finally:
        for cfg in reversed(configs):
            cfg.close()
    rows = [_summary(name, streams, *a) for (name, streams), a in acc.items()]
    rows.sort(key=lambda r: (r["streams"], [c.name for c in configs].index(r["config"])))
    gap: dict[str, Any] = {}
    if not args.no_gap:
        from transformers import AutoTokenizer

        tok_dir = resolve_gguf_model(str(gguf)).path
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        texts = [tok.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False) for i in range(8)]
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        print("[gap] llamacpp engine vs teacher forcing", file=sys.stderr, flush=True)
        gap = llamacpp_peers.logprob_gap(gguf, tok_dir, threads, prompts, max_tokens)
    return {
        "machine": info,
        "model": model_dir.name,
        "gguf": gguf.name,
        "max_tokens": max_tokens,
        "reps": rounds,
        "threads": threads,
        "client": "openai AsyncOpenAI (servers); in-process model.generate (raw)",
        "quick": args.quick,
        "rows": rows,
        "rss_mib": rss,
        "prefill_tok_s": {k: max(v) for k, v in prefill.items()},
        "bandwidth_gb_s": max(bandwidth) / 1e9,
        "step_bytes": {
            "transformers": llamacpp_peers.safetensors_step_bytes(model_dir),
            "llamacpp": llamacpp_peers.gguf_step_bytes(gguf),
        },
        "logprob_gap": gap,
        "environments": environments,
        "rounds": round_watch,
        "notes": notes,
    }


def _get(rows, config, streams):
    return next((r for r in rows if r["config"] == config and r["streams"] == streams), None)


def _bound_fraction(res: dict[str, Any], row: dict[str, Any]) -> float:
    """Weight bytes per decode step × steps/s (tokens/s ÷ streams) ÷ the measured copy bandwidth."""
    kind = "llamacpp" if "llama" in row["config"] else "transformers"
    return res["step_bytes"][kind] * row["tok_s"] / row["streams"] / (res["bandwidth_gb_s"] * 1e9)


def report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    out = [
        common.machine_line(
            res["machine"],
            model=f"{res['model']} (fp32 safetensors; GGUF {res.get('gguf', '-')}), greedy, "
            f"{res['max_tokens']} new tokens, {res['threads']} threads, {res['reps']} "
            f"round{'s' if res['reps'] != 1 else ''}",
            client=res["client"],
            mode="quick" if res["quick"] else "full",
        )
    ]
    table_rows = []
    for r in rows:
        ref = _get(rows, "llama-server -np 8", r["streams"])
        table_rows.append(
            [
                r["config"],
                r["streams"],
                r["tok_s"],
                r["tok_s"] / ref["tok_s"] if ref else float("nan"),
                r["p50_s"],
                r["p95_s"],
                res.get("prefill_tok_s", {}).get(r["config"], float("nan")),
                f"{100 * _bound_fraction(res, r):.0f}%" if "step_bytes" in res else "-",
                res["rss_mib"].get(r["config"], "-"),
                res.get("environments", {}).get(r["config"], "-"),
            ]
        )
    out.append(
        common.table(
            [
                "configuration",
                "streams",
                "tokens/s",
                "÷ llama-server",
                "p50 s",
                "p95 s",
                "prefill tok/s",
                "of bandwidth bound",
                "RSS MiB",
                "environment",
            ],
            table_rows,
            "Local engine throughput (8 streams: aggregate; raw generate = one left-padded batch)",
        )
    )
    if "step_bytes" in res:
        sb = res["step_bytes"]
        out.append(
            f"\nBandwidth bound: weights read per decode step {sb['llamacpp'] / 1e6:.0f} MB (GGUF) and "
            f"{sb['transformers'] / 1e6:.0f} MB (fp32); numpy copy bandwidth {res['bandwidth_gb_s']:.1f} GB/s "
            "(best of the run)."
        )
    gap = res.get("logprob_gap") or {}
    if gap:
        gap_rows = [[k, *v] for k, v in gap.items() if isinstance(v, list | tuple)]
        out.append("")
        out.append(
            common.table(
                ["llamacpp engine, sampled (temperature 1)", "max gap (gen − tf)", "p99", "mean", "tokens"],
                gap_rows,
                "Log-prob gap (teacher forcing: verify-rollouts --engine llamacpp)",
            )
        )
    if res.get("omp_wait_policy"):  # results from before issue #30: one policy for every configuration
        out.append(f"\nOpenMP wait policy of every configuration: `OMP_WAIT_POLICY={res['omp_wait_policy']}`.")
    if res.get("rounds"):
        out.append("")
    for i, w in enumerate(res.get("rounds") or (), 1):
        out.append(f"round {i}: {common.steady_text(w)}")
    if "rounds" not in res:  # a result from before issue #30: no round was checked
        out.append(
            f"\nNOT checked for steadiness: {res['reps']} round(s) from load {res['machine']['loadavg_1m']} at the "
            "start, one OpenMP policy imposed on every configuration: a loaded result, which ranks the "
            "configurations by how they share busy cores; do not read it as their speed."
        )
    if any(not w["steady"] for w in res.get("rounds") or ()):
        out.append(
            "A round that is NOT steady ran while other processes used the cores: its numbers rank the "
            "configurations by how they share a busy machine, not by their speed; re-run on a quiet machine."
        )
    for n in res["notes"]:
        out.append(f"note: {n}")
    out.append("\nTargets:")
    out += ["  " + line for line in targets(res)]
    return "\n".join(out)


def _ratio_line(a, b, target: float, what: str) -> str:
    if not (a and b):
        return f"n/a   {what}: not measured"
    r = a["tok_s"] / b["tok_s"]
    return f"{common.verdict(r >= target)}  {what}: {r:.2f}× (target ≥ {target:g}×)"


def targets(res: dict[str, Any]) -> list[str]:
    rows = res["rows"]
    gt1, gt8 = _get(rows, "gymserve transformers", 1), _get(rows, "gymserve transformers", 8)
    gl1, gl8 = _get(rows, "gymserve llamacpp", 1), _get(rows, "gymserve llamacpp", 8)
    ls1, ls8 = _get(rows, "llama-server -np 8", 1), _get(rows, "llama-server -np 8", 8)
    raw1, raw8 = _get(rows, "raw llama.cpp loop", 1), _get(rows, "raw llama.cpp loop", 8)
    lines = []
    if "rounds" not in res or any(not w["steady"] for w in res["rounds"]):
        lines.append("NOTE  a round was NOT steady (or not checked): every verdict below is from a loaded machine")
    lines += [
        _ratio_line(gl1, raw1, 0.9, "1 stream: gymserve llamacpp ÷ raw llama.cpp loop"),
        _ratio_line(gl8, raw8, 0.9, "8 streams: gymserve llamacpp ÷ raw llama.cpp loop"),
        _ratio_line(gl1, ls1, 1.0, "1 stream: gymserve llamacpp ÷ llama-server"),
        _ratio_line(gl8, ls8, 1.0, "8 streams: gymserve llamacpp ÷ llama-server -np 8"),
        _ratio_line(gl1, gt1, 4.0, "1 stream: gymserve llamacpp ÷ gymserve transformers"),
        _ratio_line(gl8, gt8, 4.0, "8 streams: gymserve llamacpp ÷ gymserve transformers"),
    ]
    pre = res.get("prefill_tok_s", {})
    if "gymserve llamacpp" in pre and "llama-server -np 8" in pre:
        r = pre["gymserve llamacpp"] / pre["llama-server -np 8"]
        lines.append(
            f"{common.verdict(r >= 1.0)}  prefill: gymserve llamacpp ÷ llama-server -np 8: {r:.2f}× (target ≥ 1×)"
        )
    rss = res["rss_mib"].get("gymserve llamacpp")
    if rss is not None:
        lines.append(
            f"{common.verdict(rss * 2**20 <= 1.5e9)}  RSS of gymserve llamacpp after 8 streams: {rss} MiB (target ≤ 1.5 GB)"
        )
    lines.append(_ratio_line(gt1, _get(rows, "raw generate", 1), 0.9, "1 stream: gymserve transformers ÷ raw generate"))
    lines.append(_ratio_line(gt8, gt1, 2.0, "8 streams: gymserve transformers ÷ its 1-stream rate"))
    peers = [r for r in rows if r["config"].startswith("transformers serve") and r["streams"] == 8]
    best = max(peers, key=lambda r: r["tok_s"]) if peers else None
    lines.append(
        _ratio_line(gt8, best, 1.0, f"8 streams: gymserve transformers ÷ {best['config'] if best else 'peer'}")
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 new tokens, 1 round")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 48; quick 16)")
    p.add_argument("--reps", type=int, help="measurement rounds (default 2; quick 1)")
    p.add_argument("--model", help="model directory (default: the embedded model's safetensors copy)")
    p.add_argument("--gguf", help="GGUF file for the llama.cpp configurations (default: the embedded model's)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (the anchor; skipped without it)")
    p.add_argument("--no-peer", action="store_true", help="skip the peers (transformers serve, llama.cpp servers)")
    p.add_argument(
        "--no-transformers", action="store_true", help="skip raw generate, gymserve transformers and its peers"
    )
    p.add_argument("--no-gap", action="store_true", help="skip the log-prob gap measurement")
    p.add_argument("--threads", type=int, help="threads for every configuration (default: nproc)")
    p.add_argument("--no-install", action="store_true", help="never build peer venvs (skip peers that are absent)")
    args = p.parse_args(argv)
    res = run(args)
    common.save_results("engine-quick" if args.quick else "engine", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
