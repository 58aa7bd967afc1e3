"""Regenerate everything on the performance page: run the benchmarks, plot, write the docs.

Runs ``bench/growth.py``, ``bench/gateway.py``, ``bench/engine.py``, ``bench/parsers.py``,
``bench/ttft.py``, ``bench/control.py`` and ``bench/fleet.py`` (each in its own process, one after another, so they never compete for the
cores), then ``bench/plot.py``, then rewrites
``docs/performance.md`` from the JSON results under ``docs/assets/perf/``. ``make bench`` calls this.

Usage: ``python bench/run_all.py [--quick] [--only growth,gateway,engine] [--docs-only] [--no-peer]
[--llama-server PATH]`` (``make bench BENCH_ARGS="--llama-server PATH"``).
``--docs-only`` rewrites the page (and plots) from the results already there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import plot  # noqa: E402

BENCH = Path(__file__).resolve().parent
DOC = common.ROOT / "docs" / "performance.md"
ORDER = ("growth", "gateway", "engine", "multiturn", "parsers", "ttft", "control", "fleet")

# The llama.cpp comparison that stands until a quiet-machine run of bench/engine.py replaces it: the
# table the page published before (gymserve llamacpp 1.92× / 1.21× llama-server) came from one round
# at load 2.5-4.4, where llama-server ran with an OpenMP policy the benchmark imposed on it and was
# the configuration slowed most; on a quiet machine the order is reversed (issue #30).
ENGINE_PUBLISHED = """**The published numbers are issue #30's quiet-machine measurements**, not a run of this page's \
machine (which is shared and loaded; its last run is below, marked as such). 2 cores, AVX-512 Xeon, load \
0.5 at the start; llama-server and llama-cpp-python built from the same llama.cpp (the sdist's vendored \
copy, `GGML_NATIVE=OFF`, AVX2/AVX-512/VNNI/BF16, no AMX); the embedded 0.5B GGUF, greedy, 48 new tokens; \
`python bench/engine.py --reps 2 --llama-server PATH` (then still with `OMP_WAIT_POLICY=PASSIVE` set for \
every configuration):

| configuration | 1 stream tok/s | 8 streams tok/s | prefill tok/s |
|---|---|---|---|
| gymserve llamacpp | 15.67 (0.87×) | 44.84 (**0.76×**) | 156 (0.75×) |
| raw llama.cpp loop (in process) | 16.36 (0.90×) | 44.58 (0.76×) | 123 |
| llama-server -np 8 | 18.11 (1.00×) | 58.73 (1.00×) | 209 |
| gymserve transformers | 8.98 | 25.67 | 336 |

A second, independent measurement the same afternoon (load 0.12 → 0.83), llama-server with its own \
defaults (`-np 8 -c 16384 -t 2 -tb 2`, no environment set), both through `/v1/chat/completions`, greedy, \
48 tokens, best of 2 interleaved rounds:

| configuration | 1 stream tok/s | 8 streams tok/s |
|---|---|---|
| gymserve llamacpp (`--temperature 0`) | 16.83 (**0.65×**) | 31.51 (**0.53×**) |
| llama-server, its defaults | 25.80 | 59.29 |

gymserve equals its own raw llama.cpp loop, so the gap is in how llama.cpp is configured and driven, \
not in Python; closing it is open work (issue #30).

**Reproducing a table.** On a quiet machine (nothing else running; `uptime` below 1), \
`python bench/engine.py --reps 2 --llama-server PATH`, with `PATH` a `llama-server` built from the \
llama.cpp that llama-cpp-python vendors. No environment is set for all configurations: each runs with \
the environment the benchmark was started with — llama-server as its users run it (llama.cpp's default, \
spinning OpenMP threads), gymserve's llamacpp engine with the policy it picks itself \
(`OMP_WAIT_POLICY=PASSIVE` unless the environment names one) — and the table's *environment* column \
says what each ran with. The machine line names the CPU's vector flags (avx2, avx512f, amx_tile…), the \
command, and the load average at the start and end of the run; each round is checked \
(`bench/common.py`'s `LoadWatch`: the 1-minute load moved by at most 1.0 and other processes used at \
most 0.5 core) and one that was not steady is printed as `NOT steady` — re-run it before publishing. \
Every benchmark's machine line carries the same check over its whole run."""


def run_benchmarks(names: list[str], quick: bool, no_peer: bool, llama_server: str | None = None) -> list[str]:
    failed = []
    for name in names:
        cmd = [sys.executable, str(BENCH / f"{name}.py")] + (["--quick"] if quick else [])
        if no_peer and name in ("gateway", "engine"):
            cmd.append("--no-peer")
        if llama_server and name == "engine":
            cmd += ["--llama-server", llama_server]
        print(f"\n=== {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
        print(f"=== {name}: {time.monotonic() - t0:.0f} s", flush=True)
    return failed


def _section(name: str, title: str, intro: str, prefer_quick: bool, plot_image: bool = True) -> str:
    import importlib

    res = plot.load(name, prefer_quick)
    if res is None:
        return f"## {title}\n\nNo results yet: run `python bench/{name}.py`.\n"
    mod = importlib.import_module(name)
    text = mod.report(res)
    lines = text.splitlines()
    machine = lines[0].removeprefix("machine: ")
    out: list[str] = []
    for line in lines[1:]:
        if line.startswith("|") and out and out[-1] and not out[-1].startswith("|"):
            out[-1] = f"*{out[-1]}*"  # the table's title, then the blank line a Markdown table needs
            out.append("")
        out.append(line)
    body = "\n".join(out).strip()
    # Targets and notes as a list under the table.
    body = (
        body.replace("\nTargets", "\n\n**Targets**")
        .replace("\n  PASS", "\n- PASS")
        .replace("\n  FAIL", "\n- FAIL")
        .replace("\n  n/a", "\n- n/a")
        .replace("\n  NOTE", "\n- NOTE")
    )
    mode = (
        "quick mode on a shared, busy machine: indicative only; `make bench` reruns the full version"
        if res.get("quick")
        else "full mode"
    )
    image = f"![{title}](assets/perf/{name}.png)\n" if plot_image else ""
    return f"## {title}\n\n{intro}\n\n*Machine: {machine}.* ({mode})\n\n{body}\n\n{image}"


VLLM_CPU_SUMMARY = common.ROOT / "docs" / "assets" / "perf" / "vllm-cpu-summary.txt"


def _vllm_cpu_section() -> str:
    """The real-vLLM CPU numbers: ``bench/gpu_check.sh``'s summary on vLLM's CPU build, copied to
    ``docs/assets/perf/vllm-cpu-summary.txt`` (``make bench`` does not run it: it needs
    ``.venv-vllm`` and a CPU with AVX-512)."""
    title = "## vLLM CPU: direct and through the gateway\n\n"
    intro = (
        "A real vLLM (its x86-64 CPU build, `vllm-cpu`, in `.venv-vllm`: `make vllm-env`) serving the "
        "embedded Qwen2.5-Coder-0.5B-Instruct in float32 with `--enforce-eager`: vLLM's own OpenAI server "
        "against gymserve's local backend on the vllm engine (tokens/s, the same prompts), and the chat "
        "gateway's added latency: the same greedy calls (`BENCH_MAX_TOKENS` tokens each, token IDs and log-probs asked "
        "for both ways) sent straight to vLLM's server and through a gymserve chat backend in front of "
        "it (`upstream_control: vllm`), alternated call by call in the same run so the machine's load "
        "falls on both alike. Script: `PYTHON=.venv-vllm/bin/python SKIP_SUITE=1 bash bench/gpu_check.sh` "
        "(its summary copied to `docs/assets/perf/vllm-cpu-summary.txt`; `make bench` does not run it). "
        "On a GPU the same script is the GPU check ([vllm engine](model-servers/vllm-engine.md)).\n\n"
    )
    if not VLLM_CPU_SUMMARY.is_file():
        return title + intro + "No results yet.\n"
    return title + intro + "```text\n" + VLLM_CPU_SUMMARY.read_text(encoding="utf-8").strip() + "\n```\n"


def write_docs(prefer_quick: bool = False) -> Path:
    plot.main(["--quick"] if prefer_quick else [])
    parts = [
        "# Performance\n",
        "Everything on this page is regenerated by one command, `make bench` (`python bench/run_all.py`), "
        "from the scripts in `bench/`; each script also runs alone, and `--quick` gives a short version "
        "in seconds to minutes. Every number is compared with a baseline measured in the same run — "
        "absolute numbers on a small shared machine move by 10% or more between runs, ratios much less. "
        "Raw results: `docs/assets/perf/*.json`.\n",
        _section(
            "engine",
            "Local engine throughput",
            "gymserve's token-exact local backend over HTTP, on each CPU engine, against its ceiling and "
            "its peers, on the embedded model: the transformers engine against `model.generate` in one "
            "process (8 streams as one left-padded batch) and `transformers serve` with and without "
            "`--continuous-batching` on the fp32 safetensors copy; the llamacpp engine against a raw "
            "llama.cpp decode loop in one process, llama.cpp's own `llama-server -np 8` and "
            "llama-cpp-python's server on the GGUF file itself. *prefill tok/s*: a ~1,000-token prompt "
            "no cache holds; *of bandwidth bound*: weight bytes read per decode step × steps/s ÷ a numpy "
            "copy bandwidth measured in the same run. All configurations are loaded first and measured "
            "in interleaved rounds. Script: `bench/engine.py` (`--llama-server PATH` names the binary, "
            "built from the llama.cpp source llama-cpp-python vendors).\n\n" + ENGINE_PUBLISHED,
            prefer_quick,
        ),
        _section(
            "multiturn",
            "Multi-turn rollouts",
            "Concurrent agent sessions × 4 turns, each later turn adding a ~120-token tool result to the "
            "whole earlier conversation, greedy, 32 tokens per turn, streamed: gymserve on the llamacpp "
            "engine getting its own token fields back (so the prefix splice and the sequence's kept KV "
            "apply), llama-server with its prompt cache (`cache_prompt`, one slot per session) and gymserve "
            "on the transformers engine. *tok/s*: generated tokens of the rollouts that finished every turn "
            "÷ the wall time; *TTFT*: the median time to the first content token of each turn. Target: "
            "gymserve llamacpp ≥ 1.3× llama-server. Script: `bench/multiturn.py` (`--llama-server PATH`; "
            "`--quick`: 2 sessions, 16 tokens per turn). Reproduce on a quiet machine: "
            "`python bench/multiturn.py --llama-server PATH` (8 sessions).",
            prefer_quick,
            plot_image=False,
        ),
        _section(
            "gateway",
            "Gateway overhead (chat backend)",
            "Multi-turn tool-calling Responses requests (1 KB, 10 KB and 100 KB histories) through "
            "gymserve's `/v1/responses` to a fast fake chat server, compared with the equivalent chat "
            "request sent straight to the fake (`direct`) and with NeMo Gym 0.7.0's `vllm_model` server "
            "in front of the same fake (`nemo-gym`). Each server runs in its own process; *server CPU* is "
            "that process's CPU time per 1,000 requests. Script: `bench/gateway.py`.",
            prefer_quick,
        ),
        _section(
            "growth",
            "Cost growth with conversation length",
            "The local backend's work around the engine for one request carrying N earlier turns with "
            "their token fields (as a trainer sends them): `responses_to_chat`, `build_prompt` (chat "
            "template with the real tokenizer + prefix splice) and `chat_to_response`. Note that the "
            "request itself grows quadratically with the turns, because every earlier turn carries its "
            "whole prompt's token IDs. Script: `bench/growth.py`.",
            prefer_quick,
        ),
        _section(
            "ttft",
            "Streaming latency (local engine)",
            "Time to the first event and to the first generated output of a streamed `/v1/responses` "
            "call on the embedded model (greedy), as a fraction of the same request's non-streamed "
            "total, for a text answer and for a tool call (whose first argument delta can only come "
            "after the model has written the call's head). Script: `bench/ttft.py`.",
            prefer_quick,
            plot_image=False,
        ),
        _section(
            "parsers",
            "Streaming parser cost",
            "The tool-call and reasoning parsers fed a generation one character at a time, for texts of "
            "N and 2N characters, each case stretching one part (arguments in every format, plain "
            "content, whitespace, long names, reasoning): the 2N/N ratio is ~2 when the cost is linear, "
            "~4 when quadratic. Script: `bench/parsers.py`.",
            prefer_quick,
            plot_image=False,
        ),
        _section(
            "control",
            "Serving a policy being trained",
            "How long a weight update takes on the embedded model (full weights from disk and from "
            "in-process tensors, a LoRA swap) against the floor of copying the same tensors in place, and "
            "what updates arriving ten times a minute cost a steady load of concurrent multi-turn sessions "
            "in each pause mode, against the same load without updates (the tiny random-weight model: the "
            "embedded one is too slow on this machine for minutes of steady load). Script: "
            "`bench/control.py`; what the modes do: [serving a policy being trained]"
            "(concepts/training-control.md). On a shared machine the configurations, measured 30 s apart "
            "in interleaved rounds, move with its load by up to a third; a ratio above 1 is that noise, and "
            "the counts (failed, dropped, aborted, tokens thrown away) are what the modes change.",
            prefer_quick,
            plot_image=False,
        ),
        _section(
            "fleet",
            "Replica routing on a simulated fleet",
            "gymserve's chat backend and router (policy, sessions, circuit breakers, retry budget, health "
            "probes: the real code) in front of simulated engine replicas with continuous batching, chunked "
            "prefill and a bounded LRU prefix cache, on a virtual-time event loop (deterministic for a seed). "
            "Multi-turn rollouts whose prompts grow by each turn's generation and tool result; one replica is "
            "killed part way and another slowed. Each policy gets the same rollouts. Then the router's own "
            "CPU cost per call as the fleet grows. Script: `bench/fleet.py`; the policies: "
            "[several replicas](model-servers/vllm.md#several-replicas-and-session-affinity).",
            prefer_quick,
        ),
        _vllm_cpu_section(),
    ]
    DOC.write_text("\n".join(parts))
    return DOC


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the short version of every benchmark")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(ORDER)}")
    p.add_argument("--no-peer", action="store_true", help="skip the peers (NeMo Gym, transformers serve)")
    p.add_argument("--docs-only", action="store_true", help="only rewrite plots and docs from existing results")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary for bench/engine.py's anchor")
    args = p.parse_args(argv)
    failed = []
    if not args.docs_only:
        names = [n for n in ORDER if not args.only or n in args.only.split(",")]
        failed = run_benchmarks(names, args.quick, args.no_peer, args.llama_server)
    print(write_docs(prefer_quick=args.quick))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
