"""What an engine reads from a Hugging Face model directory without loading weights.

``read_model_meta`` reads ``config.json`` (required) and ``generation_config.json`` (optional), the
files ``transformers`` itself reads for these values; multimodal configs that nest the language model
under ``text_config`` are read there too. The vLLM and TensorRT-LLM adapters use it: their libraries
load the weights, gymserve only needs the token-level facts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gymserve.errors import EngineError


@dataclasses.dataclass(frozen=True)
class ModelMeta:
    """What the local backend needs to know about a model directory, read from its JSON files
    (no weights loaded): every EOS ID (``generation_config.json`` may list several), vocabulary size,
    the model's own context length, and its ``model_type``."""

    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_position_embeddings: int | None
    model_type: str | None = None


def read_model_meta(model_dir: str | Path) -> ModelMeta:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional) of ``model_dir``."""
    model_dir = Path(model_dir)
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise EngineError(f"{model_dir} has no config.json: give a Hugging Face model directory") from exc
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    eos: list[int] = []
    gen_path = model_dir / "generation_config.json"
    sources = [json.loads(gen_path.read_text(encoding="utf-8"))] if gen_path.exists() else []
    sources += [cfg, text_cfg]
    for src in sources:
        ids = src.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and i not in eos:
                eos.append(i)
    if not eos:
        raise EngineError(f"{model_dir}: neither generation_config.json nor config.json names an eos_token_id")
    vocab = cfg.get("vocab_size") or text_cfg.get("vocab_size")
    if not isinstance(vocab, int):
        raise EngineError(f"{model_dir}/config.json has no vocab_size")
    ctx = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings")
    return ModelMeta(tuple(eos), vocab, ctx if isinstance(ctx, int) else None, cfg.get("model_type"))
