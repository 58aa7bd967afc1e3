"""PNG plots of the benchmark results in ``docs/assets/perf/*.json`` (matplotlib, no display).

Reads the full-mode results (``engine.json``, ``gateway.json``, ``growth.json``, ``fleet.json``), or
the ``*-quick.json`` ones where no full run exists, and writes ``engine.png``, ``gateway.png``,
``growth.png`` and ``fleet.png`` beside them. Usage: ``python bench/plot.py [--quick]`` (``--quick``: prefer the
quick results).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def load(name: str, prefer_quick: bool = False) -> dict[str, Any] | None:
    """The results of benchmark ``name`` (full unless missing or ``prefer_quick``), or None."""
    order = [f"{name}-quick", name] if prefer_quick else [name, f"{name}-quick"]
    for stem in order:
        path = common.RESULTS_DIR / f"{stem}.json"
        if path.exists():
            return json.loads(path.read_text())
    return None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _caption(res: dict[str, Any]) -> str:
    m = res["machine"]
    return f"{m['nproc']} cores, load {m['loadavg_1m']} at start; {'quick' if res.get('quick') else 'full'} mode"


def plot_engine(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    configs = list(dict.fromkeys(r["config"] for r in res["rows"]))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(configs))
    for i, cfg in enumerate(configs):
        vals = []
        for streams in (1, 8):
            row = next((r for r in res["rows"] if r["config"] == cfg and r["streams"] == streams), None)
            vals.append(row["tok_s"] if row else 0)
        bars = ax.bar([x + i * width for x in (0, 1)], vals, width, label=cfg)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["1 stream", "8 concurrent streams"])
    ax.set_ylabel("generated tokens/s (aggregate)")
    ax.set_title(f"Local engine: {res['model']}, greedy, {res['max_tokens']} new tokens\n{_caption(res)}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "engine.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_gateway(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = res["rows"]
    sizes = sorted({r["kb"] for r in rows})
    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(2, len(sizes), figsize=(4 * len(sizes), 6.5), squeeze=False)
    for j, kb in enumerate(sizes):
        for t in targets:
            cells = sorted((r for r in rows if r["kb"] == kb and r["target"] == t), key=lambda r: r["concurrency"])
            cs = [r["concurrency"] for r in cells]
            axes[0][j].plot(cs, [r["rps"] for r in cells], marker="o", label=t)
            axes[1][j].plot(cs, [r["p50_ms"] for r in cells], marker="o", label=t)
        for i, label in enumerate(("requests/s", "p50 latency (ms)")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(f"{kb} KB history", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Responses gateway over a fake chat backend ({_caption(res)})", fontsize=9)
    fig.tight_layout()
    path = out / "gateway.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_growth(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = res["rows"]
    turns = [r["turns"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    bottom = [0.0] * len(rows)
    for stage, label in (
        ("convert", "responses_to_chat"),
        ("prompt", "build_prompt (template + splice)"),
        ("back", "chat_to_response"),
    ):
        vals = [r[stage] / 1000 for r in rows]
        ax1.bar([str(t) for t in turns], vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_xlabel("turns in the conversation")
    ax1.set_ylabel("ms per request")
    ax1.legend(fontsize=7)
    ax1.set_title("Work around the engine, per request", fontsize=9)
    base = rows[0]["total"] / rows[0]["turns"]
    ax2.plot(turns, [r["total"] / r["turns"] for r in rows], marker="o", label="µs per turn")
    ax2.axhline(base, color="grey", linestyle="--", linewidth=0.8, label="1-turn cost")
    ax2.set_xlabel("turns")
    ax2.set_ylabel("µs per turn (flat = linear growth)")
    ax2.legend(fontsize=7)
    ax2.set_title(_caption(res), fontsize=9)
    fig.tight_layout()
    path = out / "growth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_fleet(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = res["rows"]
    policies = [r["policy"] for r in rows]
    colors = ["tab:grey", "tab:orange", "tab:blue"][: len(policies)]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    panels = (
        ("prefix-cache hit rate (%)", [100 * r["hit_rate"] for r in rows], "%.1f", 90.0),
        ("generated tokens / simulated s", [r["tok_s"] for r in rows], "%.0f", 1.5 * rows[0]["tok_s"]),
        ("p99 turn latency (simulated s)", [r["p99_s"] for r in rows], "%.1f", None),
    )
    for ax, (label, vals, fmt, goal) in zip(axes, panels):
        bars = ax.bar(range(len(policies)), vals, color=colors)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
        ax.set_xticks(range(len(policies)), [p.replace("-", "-\n", 1) for p in policies], fontsize=7)
        ax.set_title(label, fontsize=9)
        if goal is not None:
            ax.axhline(goal, color="green", linestyle="--", linewidth=0.8, label="goal")
            ax.legend(fontsize=7)
    ax = axes[3]
    for policy, color in zip(policies, colors):
        cells = sorted((r for r in res["scale"] if r["policy"] == policy), key=lambda r: r["replicas"])
        ax.plot(
            [r["replicas"] for r in cells],
            [r["router_us_per_call"] for r in cells],
            marker="o",
            color=color,
            label=policy,
        )
    ax.set_xscale("log", base=2)
    sizes = sorted({r["replicas"] for r in res["scale"]})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("replicas (sessions = 8 x replicas)")
    ax.set_ylabel("µs CPU per call (pick + release)")
    ax.set_title("router cost", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    wl = res["workload"]
    fig.suptitle(
        f"Simulated fleet: {wl['replicas']} replicas, {wl['sessions']} concurrent rollouts, one replica killed at "
        f"{100 * wl['kill_at']:.0f}% and one {wl['slow_factor']:g}x slower from {100 * wl['slow_at']:.0f}% "
        f"({_caption(res)})",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / "fleet.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="prefer the quick results")
    args = p.parse_args(argv)
    out = common.RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in (
        ("engine", plot_engine),
        ("gateway", plot_gateway),
        ("growth", plot_growth),
        ("fleet", plot_fleet),
    ):
        res = load(name, args.quick)
        if res is None:
            print(f"no results for {name}; run bench/{name}.py first", file=sys.stderr)
            continue
        print(fn(res, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
