"""The tiny random-weight Qwen2 model the fast tests (``tiny_model_dir``) and ``bench/control.py`` use:
2 layers, hidden size 64, the embedded model's real tokenizer and chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def build_tiny_model(out: Path, embedded_dir: Path) -> Path:
    """Write the model into ``out`` (name it like the embedded model, e.g. ``Qwen2.5-Coder-tiny``,
    so ``auto`` picks the same tool-call parser for both); returns ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    from gymserve.engine.hf_models import MODEL_LOAD_LOCK

    torch.manual_seed(0)
    with MODEL_LOAD_LOCK:  # no other thread's model load may have torch patched while this one builds
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (embedded_dir / name).exists():
            shutil.copy(embedded_dir / name, out / name)
    return out
