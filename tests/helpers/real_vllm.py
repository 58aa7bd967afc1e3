"""Shared by the real-vLLM tier (``tests/real_vllm``)."""

from __future__ import annotations

from typing import Any


def fields(obj: Any) -> dict[str, Any]:
    """The training fields of a chat message, a streamed delta or a Responses item (SDK object or dict)."""
    extra = obj.model_extra if hasattr(obj, "model_extra") else obj
    return {k: extra.get(k) for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}
