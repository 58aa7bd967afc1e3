"""``/tokenize`` and ``/detokenize`` on the local backend, answered from its own tokenizer and template.

The chat form runs ``request.chat_prompt``, the very function the chat route builds its prompt with,
so ``tokens`` are the IDs generation would see for the same messages: prefix splice applied when the
messages carry earlier turns' token fields, ``required_prefix_token_ids`` honoured, and the same 400s
when they cannot be. The prompt form tokenizes the text as ``/v1/completions`` does
(``add_special_tokens`` default true). ``max_model_len`` is the engine's context window.
``token_strs`` are the tokenizer's own token strings (``convert_ids_to_tokens``), as vLLM returns
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gymserve.backends.context import RequestContext
from gymserve.backends.local.request import chat_prompt
from gymserve.protocol import check_token_ids


class LocalTokens:
    """``Backend.tokenize`` / ``detokenize`` for ``LocalBackend`` (a mixin over its engine,
    tokenizer and template)."""

    engine: Any
    tokenizer: Any
    template: Any

    if TYPE_CHECKING:  # LocalBackend's (its model identity)

        def check_model(self, requested: Any) -> None: ...

    async def tokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``TokenizeResponse`` for a checked ``convert.tokenize_request`` body. Raises
        ``InvalidRequestError`` (400) as the chat route would for the same messages."""
        self.check_model(request.get("model"))
        if "messages" in request:
            ids = chat_prompt(request, template=self.template, engine=self.engine).token_ids
        else:
            ids = list(
                self.tokenizer(request["prompt"], add_special_tokens=request.get("add_special_tokens", True))[
                    "input_ids"
                ]
            )
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.engine.context_window, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """``{"prompt": text}``: ``tokens`` decoded with special tokens kept (vLLM's default).
        Raises ``InvalidRequestError`` naming ``tokens[i]`` for an ID outside the vocabulary."""
        self.check_model(request.get("model"))
        ids = check_token_ids(request["tokens"], param="tokens", vocab_size=self.engine.vocab_size, allow_empty=True)
        return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}
