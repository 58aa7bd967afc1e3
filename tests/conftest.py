"""Shared fixtures: the embedded model's real tokenizer, a tiny random-weight Qwen2 model that
uses it (fast tests), and the real embedded model (few, short tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The safetensors copy of the embedded model (built on first use, ~1-2 min, then cached)."""
    from gymserve.engine.model_store import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A 2-layer random-weight Qwen2 model with the embedded model's real tokenizer and template."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Named like the embedded model so `auto` picks the same tool-call parser for both.
    out = tmp_path_factory.mktemp("Qwen2.5-Coder-tiny")
    real = json.loads((embedded_dir / "config.json").read_text())
    cfg = Qwen2Config(
        vocab_size=real["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (embedded_dir / name).exists():
            shutil.copy(embedded_dir / name, out / name)
    return out
