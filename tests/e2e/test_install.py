"""``make install``: torch first (its CPU build), then gymserve with torch pinned.

The Makefile's order and switches are read from ``make -n`` (what make would run); the torch step,
``scripts/install_torch.py``, runs for real in the modes that install nothing (keep the installed
torch, check the pin), against this environment's torch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_torch.py"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_n(*args: str) -> list[str]:
    done = subprocess.run(
        ["make", "-n", "-B", "install", "VENV=/tmp/gymserve-venv", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def _index(lines: list[str], needle: str) -> int:
    return next(i for i, line in enumerate(lines) if needle in line)


def test_torch_is_installed_first_then_pinned_for_the_extras():
    lines = make_n()
    torch_step = _index(lines, "scripts/install_torch.py --torch")
    llama_step = _index(lines, "scripts/install_llamacpp.py --constraints /tmp/gymserve-venv/torch-constraints.txt")
    extras = _index(lines, '-e ".[local,llamacpp,test,docs,lint]"')
    check = _index(lines, "scripts/install_torch.py --check")
    assert torch_step < llama_step < extras < check
    assert '--torch "torch==2.13.0"' in lines[torch_step] and "--try-local" in lines[torch_step]
    assert '--index "https://download.pytorch.org/whl/cpu"' in lines[torch_step]
    assert "-c /tmp/gymserve-venv/torch-constraints.txt" in lines[extras]
    assert "--constraints /tmp/gymserve-venv/torch-constraints.txt" in lines[torch_step]


def test_overrides():
    [index_only] = [x for x in make_n("TORCH_INDEX=https://mirror.example/whl/cpu") if "--torch" in x]
    assert '--index "https://mirror.example/whl/cpu"' in index_only and "--try-local" not in index_only
    [own] = [x for x in make_n("TORCH=") if "--torch" in x]
    assert '--torch ""' in own
    [other] = [x for x in make_n("TORCH=torch==2.6.0") if "--torch" in x]
    assert '--torch "torch==2.6.0"' in other and "--try-local" in other


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_keeping_the_installed_torch_pins_it_and_names_its_build(tmp_path):
    pytest.importorskip("torch")
    import torch

    pins = tmp_path / "torch-constraints.txt"
    done = run_script("--torch", "", "--constraints", str(pins))
    assert done.returncode == 0, done.stdout + done.stderr
    assert pins.read_text() == f"torch=={metadata.version('torch')}\n"
    build = "CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
    assert f"torch {torch.__version__} is a {build}" in done.stdout
    assert "from the environment (TORCH is empty" in done.stdout

    assert run_script("--check", "--constraints", str(pins)).returncode == 0
    pins.write_text("torch==0.0.1\n")
    changed = run_script("--check", "--constraints", str(pins))
    assert changed.returncode == 1 and "torch changed from 0.0.1 to" in changed.stdout


def test_describe_build():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import install_torch
    finally:
        sys.path.pop(0)
    assert install_torch.describe_build({"version": "2.13.0+cpu", "cuda": None, "hip": None}) == (
        True,
        "torch 2.13.0+cpu is a CPU build (torch.version.cuda is None)",
    )
    assert install_torch.describe_build({"version": "2.13.0", "cuda": "13.0", "hip": None}) == (
        False,
        "torch 2.13.0 is a CUDA 13.0 build, not the CPU build",
    )
    assert install_torch.describe_build({"version": "2.13.0+rocm6.4", "cuda": None, "hip": "6.4"})[0] is False


def test_getting_started_quotes_the_makefiles_install_commands():
    """The extras and the constraints file Getting started says ``make install`` uses are the Makefile's."""
    import re

    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    [quoted] = re.findall(r'`pip install -c \.venv/torch-constraints\.txt -e "(\.\[[\w,]+\])"`', page)
    [extras] = [x for x in make_n() if "-c /tmp/gymserve-venv/torch-constraints.txt -e" in x]
    assert f'-e "{quoted}"' in extras, f"docs say {quoted}; the Makefile runs: {extras}"
    assert "`.venv/torch-constraints.txt`" in page


# ------------------------------------------------------------------ llama-cpp-python (scripts/install_llamacpp.py)
def _install_llamacpp():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import install_llamacpp
    finally:
        sys.path.pop(0)
    return install_llamacpp


def test_llamacpp_build_progress_is_one_line_per_tenth():
    """pip -v's build output (ninja's [N/TOTAL] steps among compiler lines) becomes one progress
    line per tenth with the time spent; pip's results pass through; other lines are dropped."""
    mod = _install_llamacpp()
    pip_output = [
        "Collecting llama-cpp-python>=0.3.36",
        "  Building wheel for llama-cpp-python (pyproject.toml): started",
    ]
    pip_output += [f"  [{n}/206] /usr/bin/c++ -O3 -c ggml/src/file{n}.cpp" for n in range(1, 207)]
    pip_output += ["Successfully built llama-cpp-python", "Successfully installed llama-cpp-python-0.3.36"]
    clock = iter(float(t) for t in range(0, 10_000, 3)).__next__  # 3 s later at each reading
    shown = list(mod.progress(pip_output, clock=clock))
    steps = [s for s in shown if s.startswith("llama-cpp-python: building")]
    assert len(steps) == 11  # 0%, 10%, ... 100%
    assert steps[0] == (
        "llama-cpp-python: building llama.cpp from source (once; pip caches the wheel): 1/206 (0%), 3 s"
    )
    assert steps[-1].endswith("206/206 (100%), 33 s")
    assert shown[-2:] == ["Successfully built llama-cpp-python", "Successfully installed llama-cpp-python-0.3.36"]


def test_llamacpp_installed_is_left_alone():
    """With llama-cpp-python installed and importable, the script runs no pip and says so."""
    pytest.importorskip("llama_cpp")
    mod = _install_llamacpp()
    installed = metadata.version("llama-cpp-python")
    assert mod.satisfied(mod.SPEC) == installed
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install_llamacpp.py")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0
    assert done.stdout == f"llama-cpp-python {installed} is installed ({mod.SPEC}); nothing to do\n"
    assert mod.satisfied("llama-cpp-python>=99") is None


def test_llamacpp_spec_is_the_extras():
    """The script installs what the llamacpp extra asks for, so the extras step finds it satisfied."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert _install_llamacpp().SPEC in extra["llamacpp"]
