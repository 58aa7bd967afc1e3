"""GPU-only token-exact tests over the vLLM engine (``bench/gpu_check.sh`` runs them).

Everything here is skipped unless vLLM is importable and CUDA is available (or
``GYMSERVE_GPU_ON_CPU=1`` with vLLM's CPU build, ``make vllm-env``), so CI's ``make test`` (no GPU,
no vLLM) collects nothing that can fail; CI's real-vLLM tier is ``tests/real_vllm``. Settings come from the environment:

- ``GYMSERVE_GPU_MODEL``: a Hugging Face model directory (default: the embedded model's
  safetensors copy, built by ``gymserve.engine.model_store`` on first use);
- ``GYMSERVE_GPU_DTYPE``: vLLM dtype (default ``float32``, so log-probs can be compared with a
  float32 teacher-forced pass tightly);
- ``GYMSERVE_GPU_LOGPROB_TOL``: max ``|vLLM - teacher forcing|`` per token (default 0.02 for
  float32, 0.5 otherwise);
- ``GYMSERVE_GPU_MEMORY``: ``gpu_memory_utilization`` (default 0.5).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _why_skip() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available() and os.environ.get("GYMSERVE_GPU_ON_CPU") != "1":
        return "no CUDA device (GYMSERVE_GPU_ON_CPU=1 runs it on vLLM's CPU build, as bench/gpu_check.sh does on a CPU)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _why_skip()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=f"GPU token-exact suite: {reason}"))


@pytest.fixture(scope="session")
def gpu_settings() -> dict:
    dtype = os.environ.get("GYMSERVE_GPU_DTYPE", "float32")
    tol = float(os.environ.get("GYMSERVE_GPU_LOGPROB_TOL", "0.02" if dtype in ("float32", "float") else "0.5"))
    return {"dtype": dtype, "tol": tol, "memory": float(os.environ.get("GYMSERVE_GPU_MEMORY", "0.5"))}


@pytest.fixture(scope="session")
def gpu_model_dir() -> Path:
    if os.environ.get("GYMSERVE_GPU_MODEL"):
        return Path(os.environ["GYMSERVE_GPU_MODEL"])
    from gymserve.engine.model_store import embedded_model_dir

    return embedded_model_dir()
