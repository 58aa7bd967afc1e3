"""The openai backend: a Responses-native API (OpenAI itself, or any server that speaks Responses).

``/v1/responses`` is passed to ``{base_url}/responses`` as is, with ``model`` replaced by the
configured one; ``/v1/chat/completions`` goes to ``{base_url}/chat/completions``. gymserve's
training fields are stripped from the history first: the OpenAI API rejects unknown fields on
input items and messages. The key travels as ``Authorization: Bearer`` (``AsyncOpenAI``).
Limits, retries, error translation and context-overflow handling are those of ``ChatBackend``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from gymserve.backends.base import RequestContext
from gymserve.backends.chat import ChatBackend, secret_value
from gymserve.backends.chat_wire import strip_training_fields
from gymserve.backends.responses_over_chat import overflow_events
from gymserve.errors import ContextLengthExceededError
from gymserve.protocol import ChatRequest, ResponseDict, ResponsesRequest
from gymserve.redaction import redact_url

log = logging.getLogger("gymserve.backends")


class OpenAIBackend(ChatBackend):
    """``OpenAIBackendConfig``: one base URL, Responses passed through natively."""

    name = "openai"
    lean_http = False  # the SDK encodes the cloud's auth and URL rules

    def _replica_bases(self) -> list[str]:
        return [self.config.base_url]

    def _target(self) -> str:
        return redact_url(self.config.base_url)

    def _make_client(self, base_url: str) -> Any:
        from openai import AsyncOpenAI

        # No api_key: the SDK reads OPENAI_API_KEY, as every OpenAI client does.
        return AsyncOpenAI(base_url=base_url, api_key=secret_value(self.config.api_key),
                           default_query=self.config.default_query or None,
                           default_headers=self.config.default_headers or None,
                           timeout=self.config.timeout, max_retries=0)

    def convert_options(self):
        from gymserve.convert import ConvertOptions

        cfg = self.config
        # OpenAI accepts the developer role, and its reasoning models reject max_tokens.
        return ConvertOptions(reasoning_mode=cfg.reasoning_mode, developer_role=cfg.developer_role or "keep",
                              max_tokens_field=cfg.max_tokens_field or "max_completion_tokens")

    def _chat_body(self, request: ChatRequest) -> dict[str, Any]:
        return strip_training_fields(super()._chat_body(request))

    def _responses_body(self, request: ResponsesRequest) -> dict[str, Any]:
        body = strip_training_fields({**self.config.extra_body, **request})
        body.pop("stream", None)
        body.pop("stream_options", None)
        model = self._upstream_model(request)
        if model:
            body["model"] = model
        return body

    async def responses(self, request: ResponsesRequest, ctx: RequestContext) -> ResponseDict:
        """POST the request to ``{base}/responses`` (``model`` replaced, ``stream`` off); an
        upstream context overflow gives ``context_exceeded_response``."""
        from gymserve.convert import context_exceeded_response

        try:
            async with self.limiter.slot():
                response, _ = await self._call("responses", self._responses_body(request), ctx)
        except ContextLengthExceededError as exc:
            log.info("context window exceeded upstream; answering with an empty incomplete response: %s", exc.message)
            return context_exceeded_response(request)
        if self.config.served_model_name:
            response["model"] = self.config.served_model_name
        return response

    async def responses_stream(self, request: ResponsesRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """The upstream's own Responses event stream, passed through. An error before the first
        event raises (a plain 4xx/5xx); an overflow yields the events of the empty incomplete response."""
        body = {**self._responses_body(request), "stream": True}
        async with self.limiter.slot():
            try:
                stream, replica = await self._call("responses", body, ctx, stream=True)
            except ContextLengthExceededError:
                for event in overflow_events(request):
                    yield event
                return
            try:
                async for event in stream:
                    if self.config.served_model_name and isinstance(event, dict) and isinstance(event.get("response"), dict):
                        event["response"]["model"] = self.config.served_model_name
                    yield event
            except Exception as exc:
                raise self._translate(exc, self._url(replica, "responses"), "responses") from None
            finally:
                with contextlib.suppress(Exception):
                    await stream.close()

