"""Serving a policy being trained: how long weight updates take, and what they cost a steady load.

**Update time** — the embedded model (Qwen2.5-Coder-0.5B-Instruct, fp32: 290 tensors, ~2 GB) on
the transformers engine in this process, each operation ``--reps`` times (median):

- ``copy floor``: ``tensor.copy_`` of every new tensor into the served one — the least any in-place
  update must do, and the baseline of the ratios;
- ``full, in-process tensors``: ``engine.update_weights(state_dict)`` (validate every tensor, hand
  the copy to the worker thread between two decode steps);
- ``full, from disk``: ``engine.update_weights(path=...)`` of the safetensors copy (page cache warm),
  beside ``read floor``: reading the same files' bytes (``safetensors.torch.load_file`` maps them
  lazily, so it would measure nothing);
- ``LoRA swap, from disk`` / ``in-process``: ``load_lora_adapter(..., load_inplace=True)`` replacing
  one r=16 adapter on q/k/v/o of all 24 layers by another (``engine.lora``: merge, keep base values).

The operations run in interleaved rounds (each once per round, ``--reps`` rounds), so the machine's
load moves every row alike.

**Rollout throughput under updates** — the tiny random-weight model (2 layers; the embedded model
decodes ~1-5 tokens/s on this machine, too slow for minutes of steady load, so this measures the
serving path, not the model): ``--sessions`` concurrent multi-turn sessions (``--turns`` turns of
``--max-tokens`` tokens, each turn sent with the earlier turns' token fields, a new session when one
ends) through the official openai SDK for ``--seconds`` per configuration — ``no updates`` (the
baseline), then each pause mode with ``--updates`` updates at even intervals (default: ten a
minute): ``pause_generation(mode)`` → ``update_weights(in-process tensors)`` →
``resume_generation()``. Configurations run in interleaved rounds (``--rounds``). Per
configuration: kept generated tokens/s and its ratio to the baseline, requests failed (any error)
and dropped (sent, never answered), answers aborted and their tokens (thrown away: the session
retries the turn), answers spanning an update (``keep``), and the time paused per update.

Targets (issue 19): a LoRA swap well under a second; ``keep`` losing < 10% throughput; no request
failed or dropped in any mode.

**Process-group sync** (``--transfer tiny|0.5b``, issue 28): a full-model sync into a served
model — the copy floor, in-process tensors, the disk route, and a trainer in a second process
broadcasting over gloo on 127.0.0.1 for each bucket size of ``--buckets-mib`` (the trainer's
``send_seconds``: metadata post, broadcasts, validation and swap) — and the server process's RSS
before ``/sleep?level=2``, asleep, and awake again with its weights reloaded.

Usage: ``python bench/control.py [--quick] [--reps 3] [--seconds 30] [--updates 5] [--sessions 8]
[--rounds 2] [--skip-update-time] [--skip-load] [--transfer tiny|0.5b] [--buckets-mib 0,1,16,256]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import common  # noqa: E402

MODES = ("abort", "wait", "keep")


# ------------------------------------------------------------------------------ update time
def lora_adapter(model: Any, rank: int, seed: int) -> tuple[Any, dict[str, Any]]:
    """A random PEFT LoRA (config, tensors) on q/k/v/o of every layer of ``model``."""
    import torch
    from peft import LoraConfig

    gen = torch.Generator().manual_seed(seed)
    mods = ("q_proj", "k_proj", "v_proj", "o_proj")
    tensors = {}
    for name, layer in model.named_modules():
        if name.rsplit(".", 1)[-1] in mods:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=gen) * 0.01
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(mods)), tensors


def update_times(reps: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from gymserve.engine.model_store import embedded_model_dir
    from gymserve.engine.transformers_engine import TransformersEngine
    from gymserve.engine.weights import safetensors_files

    model_dir = embedded_model_dir()
    loop = asyncio.new_event_loop()
    engine = TransformersEngine(model_dir)
    run = loop.run_until_complete
    try:
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        served = engine.model.state_dict()
        n_bytes = sum(v.numel() * v.element_size() for v in state.values())

        def copy_floor():
            with torch.no_grad():
                for k, v in state.items():
                    served[k].copy_(v)

        files = safetensors_files(model_dir)
        adapters = [lora_adapter(engine.model, 16, seed) for seed in (1, 2)]
        tmp = Path(tempfile.mkdtemp(prefix="gymserve-bench-lora-"))
        for i, (cfg, tensors) in enumerate(adapters):
            cfg.save_pretrained(str(tmp / str(i)))
            save_file(tensors, str(tmp / str(i) / "adapter_model.safetensors"))
        turn = iter(range(1, 10_000))

        def swap_disk():
            run(engine.load_lora_adapter("policy", str(tmp / str(next(turn) % 2)), load_inplace=True))

        def swap_tensors():
            cfg, tensors = adapters[next(turn) % 2]
            run(engine.load_lora_adapter("policy", tensors=tensors, config=cfg, load_inplace=True))

        ops = {
            "copy floor": copy_floor,
            "full, in-process tensors": lambda: run(engine.update_weights(state)),
            "read floor": lambda: [f.read_bytes() for f in files],
            "full, from disk": lambda: run(engine.update_weights(path=model_dir)),
            "LoRA swap, from disk": swap_disk,
            "LoRA swap, in-process": swap_tensors,
        }
        times: dict[str, list[float]] = {name: [] for name in ops}
        # Interleaved rounds (every operation once per round), so a change of the machine's load
        # during the run moves every row alike instead of one row.
        for _ in range(reps):
            for name, fn in ops.items():
                if name.startswith("LoRA") and not engine.lora_adapters():
                    run(engine.load_lora_adapter("policy", str(tmp / "0")))  # the swaps replace a loaded adapter
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            run(engine.unload_lora_adapter("policy"))  # full updates are refused while an adapter is merged
        rows = {name: statistics.median(t) for name, t in times.items()}
        lora_params = sum(t.numel() for t in adapters[0][1].values())
    finally:
        run(engine.close())
        loop.close()
    return {
        "seconds": rows,
        "tensors": len(state),
        "bytes": n_bytes,
        "lora_rank": 16,
        "lora_params": lora_params,
        "lora_modules": len(adapters[0][1]) // 2,
    }


# ------------------------------------------------------------------------------ load under updates
class Stats:
    def __init__(self) -> None:
        self.sent = self.answered = self.failed = self.aborted = self.thrown = self.kept = self.spanning = 0
        self.turns = 0
        self.errors: list[str] = []
        self.pauses: list[float] = []


async def session(client: Any, sid: int, stop_at: float, stats: Stats, turns: int, max_tokens: int) -> None:
    while time.monotonic() < stop_at:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Session {sid}: tell me a long story."}]
        turn = 0
        while turn < turns and time.monotonic() < stop_at:
            stats.sent += 1
            try:
                done = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted: the goal is none
                stats.failed += 1
                stats.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                break
            stats.answered += 1
            choice = done.choices[0]
            extra = choice.message.model_extra or {}
            n = len(extra.get("generation_token_ids", []))
            if choice.finish_reason == "abort":
                stats.aborted += 1
                stats.thrown += n
                continue  # the turn is sampled again on the new weights
            stats.kept += n
            stats.turns += 1
            stats.spanning += bool(extra.get("weight_version_spans"))
            messages.append(
                {
                    "role": "assistant",
                    "content": choice.message.content or "",
                    **{k: extra[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")},
                }
            )
            messages.append({"role": "user", "content": "Go on."})
            turn += 1


async def updater(server: Any, mode: str, updates: int, seconds: float, weights: list[dict], stats: Stats) -> None:
    start = time.monotonic()
    for k in range(updates):
        await asyncio.sleep(max(0.0, start + seconds * (k + 1) / (updates + 1) - time.monotonic()))
        t0 = time.perf_counter()
        await asyncio.to_thread(server.pause_generation, mode, timeout=60)
        await asyncio.to_thread(server.update_weights, weights[k % 2])
        await asyncio.to_thread(server.resume_generation)
        stats.pauses.append(time.perf_counter() - t0)


async def one_config(server: Any, mode: str | None, args: argparse.Namespace, weights: list[dict]) -> dict[str, Any]:
    from openai import AsyncOpenAI

    stats = Stats()
    async with AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        t0 = time.monotonic()
        stop_at = t0 + args.seconds
        jobs = [session(client, i, stop_at, stats, args.turns, args.max_tokens) for i in range(args.sessions)]
        if mode is not None:
            jobs.append(updater(server, mode, args.updates, args.seconds, weights, stats))
        await asyncio.gather(*jobs)
        elapsed = time.monotonic() - t0
    return {
        "mode": mode or "no updates",
        "seconds": elapsed,
        "kept_tokens": stats.kept,
        "thrown_tokens": stats.thrown,
        "sent": stats.sent,
        "answered": stats.answered,
        "failed": stats.failed,
        "dropped": stats.sent - stats.answered - stats.failed,
        "aborted": stats.aborted,
        "turns": stats.turns,
        "spanning": stats.spanning,
        "updates": len(stats.pauses),
        "pause_seconds": stats.pauses,
        "errors": stats.errors[:5],
    }


def load_under_updates(args: argparse.Namespace) -> dict[str, Any]:
    from gymserve.engine.model_store import embedded_model_dir
    from gymserve.server.embed import serve_policy
    from helpers.tiny_model import build_tiny_model

    tiny = build_tiny_model(Path(tempfile.mkdtemp(prefix="Qwen2.5-Coder-tiny-")), embedded_model_dir())
    server = serve_policy(
        str(tiny),
        model_name="tiny",
        backend_config={"max_num_seqs": args.sessions, "tool_call_parser": "none", "pause_timeout": 120},
    )
    try:
        base = {k: v.clone() for k, v in server.backend.engine.model.state_dict().items()}
        noisy = {k: v * 1.01 if v.is_floating_point() else v for k, v in base.items()}
        weights = [noisy, base]
        runs: dict[str, list[dict[str, Any]]] = {}
        warm = argparse.Namespace(**{**vars(args), "seconds": min(5.0, args.seconds)})
        asyncio.run(one_config(server, None, warm, weights))  # first calls pay one-time costs; not measured
        for _ in range(args.rounds):
            for mode in (None, *MODES):
                res = asyncio.run(one_config(server, mode, args, weights))
                runs.setdefault(res["mode"], []).append(res)
                print(
                    f"  {res['mode']:>10}: {res['kept_tokens'] / res['seconds']:.1f} tok/s, {res['updates']} updates, "
                    f"{res['failed']} failed, {res['aborted']} aborted",
                    flush=True,
                )
    finally:
        server.stop()
    return {"runs": runs}


def summarize(load: dict[str, Any]) -> list[dict[str, Any]]:
    """Per configuration: totals over rounds, tokens/s, and the ratio to ``no updates``."""
    out = []
    for mode, runs in load["runs"].items():
        total = {
            k: sum(r[k] for r in runs)
            for k in (
                "seconds",
                "kept_tokens",
                "thrown_tokens",
                "sent",
                "failed",
                "dropped",
                "aborted",
                "turns",
                "spanning",
                "updates",
            )
        }
        pauses = [p for r in runs for p in r["pause_seconds"]]
        total["tok_s"] = total["kept_tokens"] / total["seconds"]
        total["pause_median"] = statistics.median(pauses) if pauses else float("nan")
        out.append({"mode": mode, **total})
    base = out[0]["tok_s"]
    for row in out:
        row["ratio"] = row["tok_s"] / base if base else float("nan")
    return out


# ------------------------------------------------------------------------------ process-group transfer
TRAINER = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "weight_trainer.py"


def transfer_times(model: str, reps: int, buckets: list[int]) -> dict[str, Any]:
    """Full-model sync times into a served model (``serve_policy`` in this process): the copy floor,
    in-process tensors, disk, and a trainer in a second process (``tests/helpers/weight_trainer.py``:
    torch + ``gymserve.trainer``) broadcasting over gloo on 127.0.0.1 for each bucket size; then the
    process's RSS around ``/sleep?level=2`` and back (wake_up, an update from disk)."""
    import json
    import os
    import subprocess

    import httpx
    import torch

    from gymserve.engine.model_store import embedded_model_dir
    from gymserve.engine.weights import safetensors_files
    from gymserve.server.embed import serve_policy
    from helpers.tiny_model import build_tiny_model

    if model == "tiny":
        model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="Qwen2.5-Coder-tiny-")), embedded_model_dir())
    else:
        model_dir = embedded_model_dir()
    (file,) = safetensors_files(model_dir)  # the trainer's state: the model's own tensors
    server = serve_policy(str(model_dir), model_name="bench", backend_config={"tool_parser": "none"})
    root = server.base_url.removesuffix("/v1")
    try:
        served = server.backend.engine.model.state_dict()
        state = {k: v.clone() for k, v in served.items()}
        n_bytes = sum(v.numel() * v.element_size() for v in state.values())

        n_tensors = len(state)

        def copy_floor() -> None:
            with torch.no_grad():
                for k, v in state.items():
                    served[k].copy_(v)

        ops = {
            "copy floor": copy_floor,
            "in-process tensors (serve_policy)": lambda: server.update_weights(state),
            "disk (POST /update_weights path)": lambda: httpx.post(
                f"{root}/update_weights", json={"update_info": {"path": str(model_dir)}}, timeout=600
            ).raise_for_status(),
        }
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(reps):
            for name, fn in ops.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        rows: dict[str, dict[str, float]] = {name: {"seconds": statistics.median(t)} for name, t in times.items()}
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
        for b in buckets:
            opts = {"bucket_bytes": b, "sends": reps + 1, "timeout": 600}
            proc = subprocess.run(
                [sys.executable, str(TRAINER), root, str(file), json.dumps(opts)],
                capture_output=True,
                text=True,
                timeout=1800,
                env=env,
            )
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            answers = out["answers"][1:]  # the first send warms both sides' allocators; not measured
            bad = [a for a in answers if "error" in a]
            if bad:
                raise RuntimeError(f"transfer failed: {bad[0]}")
            label = f"gloo, {'one broadcast per tensor' if b == 0 else f'{b / 2**20:g} MiB buckets'}"
            rows[label] = {
                "seconds": statistics.median(a["send_seconds"] for a in answers),
                "receive_seconds": statistics.median(a["receive_seconds"] for a in answers),
                "broadcasts": answers[0]["broadcasts"],
            }
            print(f"  {label}: {rows[label]['seconds']:.3f} s", flush=True)
        for d in (served, state, ops):
            d.clear()  # their references would keep the served storage alive through sleep
        rss = {"before": common.rss_mib(os.getpid(), children=False)}
        httpx.post(f"{root}/sleep", params={"level": 2}, timeout=120).raise_for_status()
        rss["asleep (level 2)"] = common.rss_mib(os.getpid(), children=False)
        t0 = time.perf_counter()
        httpx.post(f"{root}/wake_up", timeout=120).raise_for_status()
        httpx.post(f"{root}/update_weights", json={"update_info": {"path": str(model_dir)}}, timeout=600)
        wake = time.perf_counter() - t0
        rss["awake, weights reloaded"] = common.rss_mib(os.getpid(), children=False)
    finally:
        server.stop()
    return {"model": model, "tensors": n_tensors, "bytes": n_bytes, "rows": rows, "rss_mib": rss, "wake_seconds": wake}


# ------------------------------------------------------------------------------ report
def report(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = [common.machine_line(res["machine"], mode="quick" if res["quick"] else "full")]
    ut = res.get("update_time")
    if ut:
        s = ut["seconds"]
        floor = s["copy floor"]
        rows = [[k, v, v / floor] for k, v in s.items()]
        lines.append(
            common.table(
                ["operation", "seconds (median)", "× copy floor"],
                rows,
                title=f"Update time, embedded model ({ut['tensors']} tensors, {ut['bytes'] / 2**30:.2f} "
                f"GiB fp32; LoRA r={ut['lora_rank']} on {ut['lora_modules']} modules, "
                f"{ut['lora_params'] / 1e6:.1f} M parameters; {a['reps']} reps)",
            )
        )
    rows_out = []
    if res.get("load"):
        rows = summarize(res["load"])
        table_rows = [
            [
                r["mode"],
                r["tok_s"],
                r["ratio"],
                r["updates"],
                r["pause_median"],
                r["failed"],
                r["dropped"],
                r["aborted"],
                r["thrown_tokens"],
                r["spanning"],
            ]
            for r in rows
        ]
        lines.append(
            common.table(
                [
                    "configuration",
                    "kept tok/s",
                    "× no updates",
                    "updates",
                    "pause s (median)",
                    "failed",
                    "dropped",
                    "aborted",
                    "tokens thrown away",
                    "answers spanning",
                ],
                table_rows,
                title=f"Rollout throughput under updates, tiny model ({a['sessions']} sessions × "
                f"{a['turns']} turns × {a['max_tokens']} tokens, {a['seconds']:g} s per "
                f"configuration × {a['rounds']} rounds, {a['updates']} updates each)",
            )
        )
        rows_out = rows
    tt = res.get("transfer")
    if tt:
        floor = tt["rows"]["copy floor"]["seconds"]
        lines.append(
            common.table(
                ["path", "seconds (median)", "× copy floor", "receive s", "broadcasts"],
                [
                    [k, v["seconds"], v["seconds"] / floor, v.get("receive_seconds", "-"), v.get("broadcasts", "-")]
                    for k, v in tt["rows"].items()
                ],
                title=f"Full-model sync, {tt['model']} model ({tt['tensors']} tensors, {tt['bytes'] / 2**20:.1f} MiB; "
                f"trainer in a second process over gloo on 127.0.0.1; {a['reps']} reps)",
            )
        )
        lines.append(
            "RSS of the server process (MiB): "
            + ", ".join(f"{k} {v:.0f}" for k, v in tt["rss_mib"].items())
            + f"; wake_up + reload from disk {tt['wake_seconds']:.2f} s"
        )
    lines.append("Targets")
    if tt:
        gloo = min(v["seconds"] for k, v in tt["rows"].items() if k.startswith("gloo"))
        floor = tt["rows"]["copy floor"]["seconds"]
        disk = tt["rows"]["disk (POST /update_weights path)"]["seconds"]
        lines.append(
            f"  {common.verdict(gloo <= 1.5 * floor)} process group within 1.5x the copy floor: {gloo / floor:.2f}x"
        )
        lines.append(f"  {common.verdict(gloo < disk)} process group below the disk path: {gloo:.3f} s vs {disk:.3f} s")
    if ut:
        swap = ut["seconds"]["LoRA swap, in-process"]
        lines.append(f"  {common.verdict(swap < 1.0)} LoRA swap (in-process) well under a second: {swap:.3f} s")
    if rows_out:
        keep = next(r for r in rows_out if r["mode"] == "keep")
        lines.append(f"  {common.verdict(keep['ratio'] >= 0.9)} keep loses < 10% throughput: {keep['ratio']:.2f}x")
        bad = sum(r["failed"] + r["dropped"] for r in rows_out)
        lines.append(f"  {common.verdict(bad == 0)} no request failed or dropped: {bad}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, help="repetitions per update-time operation (3; 1 quick)")
    ap.add_argument("--seconds", type=float, help="seconds per load configuration (30; 10 quick)")
    ap.add_argument("--updates", type=int, help="updates per configuration (5 in 30 s: ten a minute; 2 quick)")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, help="interleaved rounds of all configurations (2; 1 quick)")
    ap.add_argument("--skip-update-time", action="store_true")
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument(
        "--transfer", choices=("tiny", "0.5b"), help="also time process-group weight sync on this model (issue 28)"
    )
    ap.add_argument(
        "--buckets-mib",
        default="0,1,16,256",
        help="bucket sizes to sweep, MiB, comma-separated (0: one broadcast per tensor)",
    )
    args = ap.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.seconds = args.seconds or (10.0 if args.quick else 30.0)
    args.updates = args.updates if args.updates is not None else (2 if args.quick else 5)
    args.rounds = args.rounds or (1 if args.quick else 2)
    res: dict[str, Any] = {
        "machine": common.machine(),
        "quick": args.quick,
        "args": {
            k: getattr(args, k) for k in ("reps", "seconds", "updates", "sessions", "turns", "max_tokens", "rounds")
        },
    }
    if not args.skip_load:
        print("rollout throughput under updates (tiny model):", flush=True)
        res["load"] = load_under_updates(args)
    if not args.skip_update_time:
        print("update time (embedded model):", flush=True)
        res["update_time"] = update_times(args.reps)
    if args.transfer:
        print(f"process-group transfer ({args.transfer} model):", flush=True)
        buckets = [int(float(b) * 2**20) for b in args.buckets_mib.split(",")]
        res["transfer"] = transfer_times(args.transfer, args.reps, buckets)
    common.save_results("control-quick" if args.quick else "control", res)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
