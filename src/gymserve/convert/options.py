"""How a Responses request is rendered as a Chat Completions request, per backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasoningMode = Literal["think_tags", "reasoning_content", "reasoning", "drop"]


@dataclass(frozen=True)
class ConvertOptions:
    """Backend-specific choices for ``responses_to_chat``.

    ``reasoning_mode``: how reasoning items from the history reach the chat assistant message:
      ``"reasoning_content"`` (the DeepSeek / older vLLM field, and what Qwen3-style HF chat templates
      read to re-emit ``<think>``), ``"reasoning"`` (vLLM ≥ 0.10 field name), ``"think_tags"``
      (``"<think>\\n{r}\\n</think>\\n\\n"`` prepended to the content, for templates and servers that
      know no reasoning field), or ``"drop"``.
    ``developer_role``: ``"system"`` folds developer messages into the single leading system message
      (HF templates reject or drop ``developer``); ``"keep"`` passes them through (OpenAI, Azure).
    ``max_tokens_field``: ``"max_tokens"`` (vLLM, SGLang, most servers) or ``"max_completion_tokens"``
      (OpenAI reasoning models reject ``max_tokens``).
    """

    reasoning_mode: ReasoningMode = "reasoning_content"
    developer_role: Literal["system", "keep"] = "system"
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
