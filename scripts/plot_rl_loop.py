"""Plot a ``gymserve train-demo`` run for the docs: reward and KL to the previous version per step,
and the teacher-forcing gap that proves each push.

    python scripts/plot_rl_loop.py RUN/steps.json   # writes docs/assets/rl-loop.json and docs/assets/rl-loop.png

The JSON copy keeps the per-step numbers and the run's configuration (without its output
directory); the PNG is what ``docs/tutorial-rl-loop.md`` shows. Needs matplotlib (``bench`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "docs" / "assets"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    run = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    run["config"].pop("out", None)  # a path on the machine that ran it
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / "rl-loop.json").write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = run["steps"]
    xs = [s["step"] for s in steps]
    fig, (ax_r, ax_k, ax_t) = plt.subplots(1, 3, figsize=(12, 3.4))
    ax_r.plot(xs, [s["reward"] for s in steps], marker="o")
    ax_r.set(title="mean reward (one-word answers)", xlabel="step (= weight version)", ylim=(0, 1.05))
    kl = [(s["step"], s["kl_to_previous"]) for s in steps if s["kl_to_previous"] is not None]
    ax_k.plot([k for k, _ in kl], [v for _, v in kl], marker="o", color="tab:orange")
    ax_k.set(title="KL(previous version ‖ this one), per token", xlabel="step")
    ax_t.semilogy(xs, [max(s["tf_max_diff"], 1e-9) for s in steps], marker="o", color="tab:green")
    ax_t.axhline(run["config"]["tolerance"], ls="--", color="gray", label="tolerance")
    ax_t.set(title="max |served − teacher-forced log-prob|", xlabel="step")
    ax_t.legend()
    for ax in (ax_r, ax_k, ax_t):
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"gymserve train-demo on {run['model']}: GRPO on a LoRA r={run['config']['rank']}, "
        f"{run['config']['prompts']} prompts × {run['config']['group']} samples per step",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(ASSETS / "rl-loop.png", dpi=110)
    print(ASSETS / "rl-loop.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
