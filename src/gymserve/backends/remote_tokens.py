"""``/tokenize`` and ``/detokenize`` over a remote API.

Two ways, chosen by the config:

- ``backend.tokenizer`` set (a Hugging Face tokenizer directory of the served model): gymserve
  answers itself, with that tokenizer and its chat template (the backend's ``chat_template_kwargs``
  as defaults) through the same ``prompting.build_prompt`` as the local backend, so messages that
  carry earlier turns' token fields are spliced and ``required_prefix_token_ids`` is honoured.
  ``max_model_len`` is the model's ``max_position_embeddings`` (``config.json`` beside the
  tokenizer), else the tokenizer's ``model_max_length``. It is gymserve's rendering: it equals the
  upstream's when both use the same template.
- otherwise the request is forwarded to the upstream's own ``POST {root}/tokenize`` (``root``: the
  base URL without ``/v1``, where vLLM and SGLang serve it) on the session's replica, the model
  name replaced; the answer is checked for a list of IDs and passed on. The upstream decides the
  splice there (NeMo RL's vLLM server and another gymserve honour token fields and
  ``required_prefix_token_ids``; a stock vLLM renders the messages' text).

The clouds (``openai``, ``azure``) have no tokenizer endpoint: 501.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from gymserve.backends.context import RequestContext
from gymserve.errors import NotSupportedError, UpstreamBadResponseError
from gymserve.protocol import check_token_ids
from gymserve.redaction import redact_url

if TYPE_CHECKING:
    from gymserve.backends.caller import UpstreamCaller
    from gymserve.backends.upstream import Upstream


class RemoteTokens:
    """``Backend.tokenize`` / ``detokenize`` for ``RemoteBackend`` (see the module docstring)."""

    upstream: Upstream
    caller: UpstreamCaller
    config: Any

    async def tokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``TokenizeResponse``: from ``backend.tokenizer``, else the upstream's ``/tokenize``."""
        own = self._own_tokenizer()
        if own is None:
            return await self._forward("tokenize", request, ctx)
        if "messages" in request:
            from gymserve.backends.local.request import chat_prompt

            ids = chat_prompt(request, template=own.template, engine=own).token_ids
        else:
            ids = list(
                own.tokenizer(request["prompt"], add_special_tokens=request.get("add_special_tokens", True))[
                    "input_ids"
                ]
            )
        strs = own.tokenizer.convert_ids_to_tokens(ids) if request.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": own.context_window, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """``{"prompt": text}``: from ``backend.tokenizer``, else the upstream's ``/detokenize``."""
        own = self._own_tokenizer()
        if own is None:
            return await self._forward("detokenize", request, ctx)
        ids = check_token_ids(request["tokens"], param="tokens", vocab_size=own.vocab_size, allow_empty=True)
        return {"prompt": own.tokenizer.decode(ids, skip_special_tokens=False)}

    def _own_tokenizer(self) -> Any:
        path = getattr(self.config, "tokenizer", None)
        if path:
            if getattr(self, "_tokenizer_info", None) is None:
                self._tokenizer_info = _load(path, dict(self.config.chat_template_kwargs or {}))
            return self._tokenizer_info
        if self.upstream.cloud:
            raise NotSupportedError(
                f"the {self.upstream.kind} backend cannot tokenize: the API has no tokenizer endpoint and its tokenizer is "
                "not public; use a chat backend (vLLM, SGLang) or the local backend",
                code="route_not_supported",
            )
        return None

    async def _forward(self, kind: str, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        body = dict(request)
        model = self.upstream.model(request)
        if model:
            body["model"] = model
        replica = self.caller.pool.pick(ctx.session_id)
        url = f"{replica.base_url.removesuffix('/v1')}/{kind}"
        result, _ = await self.caller.call(kind, body, ctx, replica=replica, url=url)
        key, ok = ("tokens", list) if kind == "tokenize" else ("prompt", str)
        if not isinstance(result.get(key), ok):
            raise UpstreamBadResponseError(f"{redact_url(url)} answered without {key}", url=redact_url(url))
        return result


def _load(path: str, default_kwargs: dict[str, Any]) -> SimpleNamespace:
    """The tokenizer at ``path``, its chat template, EOS IDs, vocabulary size and context window
    (``engine.model_meta`` reads the model files beside it when there are some)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from gymserve.engine.model_meta import read_model_meta
    from gymserve.prompting import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(path)
    meta = read_model_meta(Path(path)) if (Path(path) / "config.json").is_file() else None
    eos = tuple(meta.eos_token_ids) if meta and meta.eos_token_ids else (tokenizer.eos_token_id,)
    window = (meta.max_position_embeddings if meta else None) or tokenizer.model_max_length
    return SimpleNamespace(
        tokenizer=tokenizer,
        template=ChatTemplate(tokenizer, default_kwargs=default_kwargs),
        eos_token_ids=eos,
        vocab_size=(meta.vocab_size if meta else None) or len(tokenizer),
        context_window=int(window),
    )
