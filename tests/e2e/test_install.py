"""``make install``: torch first (its CPU build), then gymserve with torch pinned.

The Makefile's order and switches are read from ``make -n`` (what make would run); the torch step,
``scripts/install_torch.py``, runs for real in the modes that install nothing (keep the installed
torch, check the pin), against this environment's torch.
"""

from __future__ import annotations

import os
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
    extras = _index(lines, '-e ".[local,llamacpp,structured,test,docs,lint]"')
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
        "llama-cpp-python: building llama.cpp from source (once; gymserve keeps the wheel): 1/206 (0%), 3 s"
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


def _flags(text: str) -> dict[str, str]:
    """``-DKEY=VALUE`` pairs of a CMake command line."""
    pairs = [f.removeprefix("-D").split("=", 1) for f in text.split()]
    assert all(len(p) == 2 for p in pairs), text
    return dict(pairs)


def test_llamacpp_build_flags_are_portable(monkeypatch):
    """No native CPU detection (a wheel built on one machine runs on another), no AMX (its kernels
    crash in llama_decode, ggml-org/llama.cpp#20824), no AVX-512; AVX2 (x86-64-v3) on."""
    mod = _install_llamacpp()
    monkeypatch.delenv(mod.FLAGS_ENV, raising=False)
    flags = _flags(mod.cmake_flags())
    assert flags["GGML_NATIVE"] == "OFF"
    amx = {k: v for k, v in flags.items() if "AMX" in k}
    avx512 = {k: v for k, v in flags.items() if "AVX512" in k}
    assert amx == {"GGML_AMX_TILE": "OFF", "GGML_AMX_INT8": "OFF", "GGML_AMX_BF16": "OFF"}
    assert set(avx512.values()) == {"OFF"} and "GGML_AVX512" in avx512
    assert {flags[k] for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C")} == {"ON"}
    monkeypatch.setenv(mod.FLAGS_ENV, "-DGGML_NATIVE=OFF -DGGML_AVX2=OFF")
    assert mod.cmake_flags() == "-DGGML_NATIVE=OFF -DGGML_AVX2=OFF"


def test_llamacpp_flags_are_the_engines_rebuild_hint():
    """The engine's refusal of an AMX build quotes the same flags the script builds with."""
    from gymserve.engine.llamacpp_runtime import PORTABLE_CMAKE_ARGS, REBUILD_HINT

    assert _install_llamacpp().CMAKE_FLAGS == PORTABLE_CMAKE_ARGS
    assert PORTABLE_CMAKE_ARGS in REBUILD_HINT and "python scripts/install_llamacpp.py" in REBUILD_HINT


def test_llamacpp_build_passes_the_flags_to_pip_without_its_cache(monkeypatch, tmp_path):
    """What the script runs for a build: ``pip wheel --no-cache-dir`` (pip's cache is keyed by the
    source, not CMAKE_ARGS, so a cached native wheel must not come back) with CMAKE_ARGS set to the
    portable flags, into gymserve's own wheel folder."""
    mod = _install_llamacpp()
    monkeypatch.delenv(mod.FLAGS_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mod, "satisfied", lambda spec: None)
    ran: list[tuple[list[str], dict[str, str]]] = []

    class FakePopen:
        def __init__(self, cmd, *, env, **kw):
            ran.append((cmd, env))
            self.stdout = iter(["  [1/2] c++ a.cpp\n", "  [2/2] c++ b.cpp\n"])
            self.returncode = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(mod.subprocess, "Popen", FakePopen)
    installed: list[str] = []
    monkeypatch.setattr(mod, "_install_wheel", lambda install, wheels, constraints: installed.append(wheels) or 0)
    assert mod.main([]) == 0
    [(cmd, env)] = ran
    assert cmd[1:4] == ["-m", "pip", "wheel"] and "--no-cache-dir" in cmd and cmd[-1] == mod.SPEC
    wheels = cmd[cmd.index("-w") + 1]
    assert wheels == mod.wheel_dir(mod.SPEC, mod.CMAKE_FLAGS) and wheels.startswith(
        str(tmp_path / "gymserve" / "llamacpp")
    )
    assert env["CMAKE_ARGS"] == mod.CMAKE_FLAGS and env["FORCE_CMAKE"] == "1"
    assert installed == [wheels]


def test_llamacpp_wheel_folder_is_keyed_by_spec_and_flags(monkeypatch, tmp_path):
    """pip keys its wheel cache by the source only; gymserve's folder changes with the flags (and
    the requirement), so a wheel built with other flags is never taken for the portable one."""
    mod = _install_llamacpp()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    portable = mod.wheel_dir(mod.SPEC, mod.CMAKE_FLAGS)
    assert portable == mod.wheel_dir(mod.SPEC, mod.CMAKE_FLAGS)
    assert mod.wheel_dir(mod.SPEC, "-DGGML_NATIVE=ON") != portable
    assert mod.wheel_dir(mod.SPEC, mod.CMAKE_FLAGS + " -DGGML_AMX_INT8=ON") != portable
    assert mod.wheel_dir("llama-cpp-python==0.3.40", mod.CMAKE_FLAGS) != portable
    assert os.path.dirname(portable) == str(tmp_path / "gymserve" / "llamacpp")


def test_llamacpp_unportable_names_amx_and_avx512():
    mod = _install_llamacpp()
    native_xeon = {"SSE3": "1", "AVX": "1", "AVX2": "1", "AVX512": "1", "AMX_INT8": "1", "OPENMP": "1"}
    assert mod.unportable(native_xeon) == ["AMX_INT8", "AVX512"]
    assert mod.unportable({"AVX2": "1", "AMX_INT8": "1"}) == ["AMX_INT8"]
    assert mod.unportable({"AVX": "1", "AVX2": "1", "AVX512": "0", "AMX_INT8": "0"}) == []


def test_llamacpp_an_installed_amx_build_is_rebuilt(monkeypatch, capsys):
    """An AMX build already installed (pip's own native build) does not satisfy the script."""
    mod = _install_llamacpp()
    monkeypatch.delenv(mod.FLAGS_ENV, raising=False)
    monkeypatch.setattr(mod.metadata, "version", lambda name: "0.3.36")
    monkeypatch.setattr(mod, "installed_features", lambda: {"AVX2": "1", "AMX_INT8": "1"})
    assert mod.satisfied("llama-cpp-python>=0.3.36") is None
    assert "built with ['AMX_INT8']: rebuilding portably" in capsys.readouterr().out
    monkeypatch.setattr(mod, "installed_features", lambda: {"AVX2": "1", "AMX_INT8": "0"})
    assert mod.satisfied("llama-cpp-python>=0.3.36") == "0.3.36"
