"""The names a chat message or delta gives its reasoning, and how to read and write them.

``reasoning_content`` is DeepSeek's and vLLM < 0.10's name (and what Qwen3-style chat templates read
to re-emit ``<think>``); ``reasoning`` is vLLM ≥ 0.10's (gpt-oss always sends it). During the rename
vLLM sent both with the same text, so a reader takes one, never both, and a writer that must serve
clients keyed on either fills both (case CR-01).
"""

from __future__ import annotations

from typing import Any, Literal

ReasoningField = Literal["reasoning_content", "reasoning"]
REASONING_FIELDS: tuple[ReasoningField, ...] = ("reasoning_content", "reasoning")
"""Every name, the default first."""


def field_reasoning(obj: dict[str, Any]) -> str | None:
    """The reasoning text of a message or delta: the first non-empty of :data:`REASONING_FIELDS`."""
    for key in REASONING_FIELDS:
        value = obj.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def mirror_reasoning(message: dict[str, Any]) -> None:
    """Copy the reasoning text into every name that lacks it, in place (CR-01)."""
    text = field_reasoning(message)
    if text is not None:
        for key in REASONING_FIELDS:
            if not message.get(key):
                message[key] = text
