"""The anthropic backend: an Anthropic-compatible Messages API (Anthropic itself, or any server that
speaks it) behind every gymserve route.

``/v1/messages`` (and ``/v1/messages/count_tokens``) pass through to ``{base_url}/v1/messages``
with ``model`` replaced by the configured one, ``extra_body`` under the request and gymserve's
training fields removed (Anthropic rejects unknown fields); streamed, the upstream's events pass
through. ``/v1/chat/completions`` is converted to a Messages request and its answer back
(``convert.chat_to_anthropic``), and ``/v1/responses`` goes through that chat path
(``responses_over_chat``). The key travels as ``x-api-key`` with ``anthropic-version``
(``anthropic_version``, default ``2023-06-01``), as the Messages API reference defines them
(``api_key``, else ``ANTHROPIC_API_KEY``); calls go through ``AsyncAnthropic``. Limits, retries
(429, 5xx and Anthropic's 529 ``overloaded_error``), error translation and the context-window
overflow answers are ``remote.RemoteBackend``'s, as for every remote backend.

An Anthropic upstream gives no token IDs, so its answers carry no training fields.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from gymserve.backends.base import RequestContext
from gymserve.backends.remote import RemoteBackend
from gymserve.backends.upstream import Transport, Upstream, secret_value
from gymserve.convert.chat_to_anthropic import ChunksFromEvents, chat_to_messages_request, message_to_chat_completion
from gymserve.convert.chat_to_messages import context_exceeded_message
from gymserve.convert.messages_stream import context_exceeded_events
from gymserve.errors import ContextLengthExceededError, InvalidRequestError, UpstreamBadResponseError
from gymserve.protocol import ChatCompletionDict, ChatRequest, MessageDict, MessagesRequest
from gymserve.redaction import redact_url

log = logging.getLogger("gymserve.backends")
_PATHS = {"messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens", "models": "/v1/models"}


class AnthropicTransport(Transport):
    """``Transport`` over ``AsyncAnthropic``: its server-sent events parsed by the anthropic SDK's
    own stream (``ping`` skipped, an ``error`` event raised as ``APIStatusError``)."""

    def stream_class(self) -> Any:
        from anthropic import AsyncStream

        return AsyncStream


class AnthropicUpstream(Upstream):
    """``AnthropicBackendConfig``: one base URL (the server root), the anthropic SDK for every call."""

    kind = "anthropic"
    cloud = True

    def bases(self) -> list[str]:
        return [self.config.base_url]

    def url(self, base: str, kind: str) -> str:
        if kind not in _PATHS:
            raise InvalidRequestError(f"an anthropic upstream serves no {kind} API; gymserve converts to Messages")
        return base + _PATHS[kind]

    @property
    def key(self) -> str | None:
        """``api_key``, else ``ANTHROPIC_API_KEY`` (as every Anthropic client reads it)."""
        return secret_value(self.config.api_key) or os.environ.get("ANTHROPIC_API_KEY") or None

    @property
    def secrets(self) -> tuple[str, ...]:
        return (self.key,) if self.key else ()

    def transport(self, base: str) -> Transport:
        from anthropic import AsyncAnthropic, omit

        cfg = self.config
        # The Messages API's own headers (x-api-key, anthropic-version), set here rather than left to
        # the SDK: recent anthropic SDKs send the key as Authorization: Bearer and their own newest
        # anthropic-version, which Anthropic-compatible servers need not take.
        headers: dict[str, Any] = {"anthropic-version": cfg.anthropic_version, "Authorization": omit}
        if self.key:
            headers["x-api-key"] = self.key
        return AnthropicTransport(
            AsyncAnthropic(
                base_url=base,
                api_key=None,
                default_headers={**headers, **(cfg.default_headers or {})},
                default_query=cfg.default_query or None,
                timeout=cfg.timeout,
                max_retries=0,
            )
        )

    def messages_body(self, request: dict[str, Any]) -> dict[str, Any]:
        """A Messages request as sent upstream: ``extra_body`` under it, training fields removed,
        ``model`` replaced, ``stream`` left to the caller (the same rules as ``responses_body``)."""
        return self.responses_body(request)


class AnthropicBackend(RemoteBackend):
    """``RemoteBackend`` over an ``AnthropicUpstream``: Messages native, chat and Responses converted."""

    name = "anthropic"
    upstream_type = AnthropicUpstream
    upstream: AnthropicUpstream

    # ------------------------------------------------------------------ Messages API (native)
    async def _messages(self, body: dict[str, Any], ctx: RequestContext) -> MessageDict:
        """The upstream's Message for ``body``; raises ``ContextLengthExceededError`` on overflow."""
        async with self.limiter.slot():
            message, replica = await self.caller.call("messages", body, ctx)
        if not isinstance(message.get("content"), list):
            where = redact_url(self.caller.url(replica, "messages"))
            raise UpstreamBadResponseError(f"{where} answered without a Message (no content list)", url=where)
        if self.config.served_model_name:
            message["model"] = self.config.served_model_name
        return message

    async def messages(self, request: MessagesRequest, ctx: RequestContext) -> MessageDict:
        """POST ``{base}/v1/messages``; an upstream context overflow gives ``context_exceeded_message``.
        ``required_prefix_token_ids`` is a 400 before anything is sent (the API takes no token IDs)."""
        self._refuse_token_prefix(request)
        try:
            return await self._messages(self.upstream.messages_body(request), ctx)
        except ContextLengthExceededError as exc:
            log.info("context window exceeded upstream; answering with an empty Message: %s", exc.message)
            return context_exceeded_message(self.config.served_model_name or request.get("model") or "")

    def messages_stream(self, request: MessagesRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """The upstream's own event stream, passed through (an error before the first event raises:
        a plain 4xx/5xx; an overflow yields ``context_exceeded_events``)."""
        self._refuse_token_prefix(request)
        return self._events({**self.upstream.messages_body(request), "stream": True}, ctx, request.get("model"))

    def _events(self, body: dict[str, Any], ctx: RequestContext, model: Any) -> AsyncIterator[dict[str, Any]]:
        return self._native_stream(
            "messages",
            body,
            ctx,
            lambda: context_exceeded_events(self.config.served_model_name or model or ""),
            lambda event: event.get("message") if event.get("type") == "message_start" else None,
        )

    async def count_tokens(self, request: MessagesRequest, ctx: RequestContext) -> int:
        """POST ``{base}/v1/messages/count_tokens``: the upstream's own count."""
        self._refuse_token_prefix(request)
        counted, replica = await self.caller.call("count_tokens", self.upstream.messages_body(request), ctx)
        tokens = counted.get("input_tokens")
        if not isinstance(tokens, int):
            where = redact_url(self.caller.url(replica, "count_tokens"))
            raise UpstreamBadResponseError(f"{where} answered without input_tokens: {str(counted)[:200]}", url=where)
        return tokens

    # ------------------------------------------------------------------ chat (converted)
    def _as_messages(self, request: ChatRequest) -> dict[str, Any]:
        self._refuse_token_prefix(request)  # the conversion would drop it silently
        converted = chat_to_messages_request(request, default_max_tokens=self.config.default_max_tokens)
        return self.upstream.messages_body(converted)

    async def _chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """The upstream's Message as a completion; raises ``ContextLengthExceededError`` on overflow
        (``RemoteBackend.chat`` answers it with the empty length-terminated reply, ``answer`` leaves
        it to the Responses path)."""
        return message_to_chat_completion(await self._messages(self._as_messages(request), ctx))

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """The upstream's Messages events as chat chunks (``ChunksFromEvents``); an overflow's events
        become the empty length-terminated reply's chunks."""
        body = {**self._as_messages(request), "stream": True}
        chunks = ChunksFromEvents(include_usage=bool((request.get("stream_options") or {}).get("include_usage")))
        async for event in self._events(body, ctx, request.get("model")):
            for chunk in chunks.feed(event):
                yield chunk
