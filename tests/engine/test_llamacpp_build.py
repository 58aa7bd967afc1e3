"""The llamacpp engine refuses a llama.cpp built with AMX kernels (they crash in the first
``llama_decode`` on current Xeons: ggml-org/llama.cpp#20824), on any machine: the system-info text
llama.cpp reports is injected, so these tests need neither an AMX CPU nor llama-cpp-python."""

from __future__ import annotations

import sys
import types

import pytest

from gymserve.engine import llamacpp_runtime as runtime
from gymserve.errors import EngineBuildError

# llama_print_system_info() of llama-cpp-python 0.3.x as pip builds it by default on a Sapphire
# Rapids Xeon (native: AVX-512 and AMX compiled in), and as scripts/install_llamacpp.py builds it.
NATIVE_XEON = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
PORTABLE = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
)


def test_system_features_parses_llamacpps_text():
    assert runtime.system_features(NATIVE_XEON)["AMX_INT8"] == "1"
    assert runtime.system_features(PORTABLE) == {
        "SSE3": "1", "SSSE3": "1", "AVX": "1", "AVX2": "1", "F16C": "1", "FMA": "1", "BMI2": "1",
        "LLAMAFILE": "1", "OPENMP": "1",
    }  # fmt: skip


def test_an_amx_build_is_refused_with_the_cause_and_the_rebuild_command():
    with pytest.raises(EngineBuildError) as caught:
        runtime.check_build(NATIVE_XEON, environ={})
    msg = str(caught.value)
    assert "AMX_INT8 = 1" in msg
    assert "ggml-org/llama.cpp#20824" in msg
    assert "run python scripts/install_llamacpp.py (or make install)" in msg
    assert f'CMAKE_ARGS="{runtime.PORTABLE_CMAKE_ARGS}" pip install --no-cache-dir' in msg
    assert "GYMSERVE_LLAMACPP_ALLOW_AMX=1" in msg
    assert caught.value.code == "engine_build" and caught.value.status_code == 500


def test_a_portable_build_and_the_escape_hatch_pass():
    runtime.check_build(PORTABLE, environ={})
    runtime.check_build(NATIVE_XEON.replace("AMX_INT8 = 1", "AMX_INT8 = 0"), environ={})
    runtime.check_build(NATIVE_XEON, environ={"GYMSERVE_LLAMACPP_ALLOW_AMX": "1"})
    with pytest.raises(EngineBuildError):
        runtime.check_build(NATIVE_XEON, environ={"GYMSERVE_LLAMACPP_ALLOW_AMX": "yes"})  # only 1 opens it


@pytest.fixture
def amx_llama_cpp(monkeypatch):
    """A ``llama_cpp`` module whose ``llama_print_system_info()`` says AMX (what a user's own
    ``pip install llama-cpp-python`` links on a Xeon with AMX); nothing else of it is called."""
    fake = types.ModuleType("llama_cpp")
    fake.llama_log_callback = lambda fn: fn
    fake.llama_log_set = lambda cb, user: None
    fake.llama_backend_init = lambda: None
    fake.llama_print_system_info = lambda: NATIVE_XEON.encode()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(runtime, "_ready", False)
    monkeypatch.delenv("GYMSERVE_LLAMACPP_ALLOW_AMX", raising=False)
    return fake


def test_the_engine_refuses_to_load_on_an_amx_build(amx_llama_cpp, tmp_path):
    """Loading a model (the engine, the teacher forcer) goes through ``import_llama_cpp``, which
    checks the build before any model call: the user gets the message, not a segfault."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(EngineBuildError, match="ggml-org/llama.cpp#20824"):
        runtime.LlamaModel(gguf)
    with pytest.raises(EngineBuildError):
        runtime.import_llama_cpp()  # every time, not only the first


def test_the_refusal_is_one_line_from_the_cli(amx_llama_cpp):
    """``gymserve serve --engine llamacpp`` on an AMX build: one error line naming the cause, exit 2."""
    import io

    from gymserve.failures import report

    with pytest.raises(EngineBuildError) as caught:
        runtime.import_llama_cpp()
    out = io.StringIO()
    assert report(caught.value, "serve", debug=False, out=out) == 2
    [line] = out.getvalue().splitlines()
    assert line.startswith("gymserve serve: the installed llama-cpp-python was built with llama.cpp's AMX kernels")
    assert "ggml-org/llama.cpp#20824" in line and "python scripts/install_llamacpp.py" in line
