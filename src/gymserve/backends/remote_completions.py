"""``POST /v1/completions`` over a remote API: forwarded to the upstream's ``/completions``.

Written once for every ``RemoteBackend`` (a mixin): the body is the client's, under the config's
``extra_body``, with the upstream's model name; streamed chunks pass through as they come. With
``return_token_id_information`` gymserve asks for vLLM's token metadata (``return_token_ids``,
``logprobs`` ≥ 0, ``return_tokens_as_token_ids``) and puts the training fields on every choice
(``completion_tokens.CompletionTokens``; the streamed ones on each choice's finish chunk), as the
local engine does; log-probs the client did not ask for are removed again. An upstream context
overflow is the 400 ``context_length_exceeded`` (no empty stand-in answer here: the legacy API's
clients expect the error, as vLLM gives it). A gateway pause (``chat_control``) holds new calls
like chat calls and a ``wait`` pause waits for them; an ``abort`` pause lets the ones in flight
finish (the legacy API has no aborted answer to give back). The gateway's weight version goes on
each choice (streamed: on its finish chunk), as the local engine puts it (``chat_versions``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gymserve.backends.chat_versions import StreamStamp, VersionWatch, root_of, stamp_choices
from gymserve.backends.completion_tokens import CompletionTokens
from gymserve.backends.context import RequestContext
from gymserve.errors import UpstreamBadResponseError, UpstreamError
from gymserve.redaction import redact_url

if TYPE_CHECKING:
    from gymserve.backends.caller import UpstreamCaller
    from gymserve.backends.upstream import Upstream


class RemoteCompletions:
    """The completions route of ``RemoteBackend`` (which sets ``upstream``, ``caller``, ``config``)."""

    upstream: Upstream
    caller: UpstreamCaller
    config: Any
    _wants_token_ids: bool
    _admitted: Callable[[], contextlib.AbstractAsyncContextManager[Any]]
    _version_watch: Callable[[], Awaitable[VersionWatch | None]]

    def _completions_body(self, request: dict[str, Any]) -> dict[str, Any]:
        body = {**copy.deepcopy(self.config.extra_body), **request}
        body.pop("stream", None)
        body.pop("stream_options", None)
        model = self.upstream.model(request)
        if model:
            body["model"] = model
        if self._wants_token_ids:
            body.update(return_token_ids=True, return_tokens_as_token_ids=True)
            if body.get("logprobs") is None:
                body["logprobs"] = 0  # the sampled tokens' own log-probs, no alternatives
        return body

    async def completions(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """POST ``{base}/completions``; the ``Completion`` with training fields on each choice when
        ``return_token_id_information`` is set. Raises the translated upstream errors, and
        ``UpstreamTokenIdsError`` (502) for unusable token metadata."""
        body = self._completions_body(request)
        async with self._admitted(), self.caller.limiter.slot():
            watch = await self._version_watch()
            result, replica = await self.caller.call("completions", body, ctx)
            where = redact_url(self.caller.url(replica, "completions"))
            choices = result.get("choices")
            if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
                raise UpstreamError(f"{where} returned a completion without choices", url=where)
            if self._wants_token_ids:
                tokens = CompletionTokens(request, body.get("model"))
                for choice in choices:
                    tokens.take({"choices": [choice]})
                    await tokens.attach(choice, self.caller, replica, ctx, where)
        stamp_choices(watch, result, root_of(replica.base_url), on=None)
        if self.config.served_model_name:
            result["model"] = self.config.served_model_name
        return result

    async def completions_stream(self, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """The upstream's chunks, passed through; with ``return_token_id_information`` each choice's
        finish chunk carries its training fields."""
        body = {**self._completions_body(request), "stream": True}
        if request.get("stream_options"):
            body["stream_options"] = request["stream_options"]
        tokens = CompletionTokens(request, body.get("model")) if self._wants_token_ids else None
        async with self._admitted(), self.caller.limiter.slot():
            watch = await self._version_watch()
            stream, replica = await self.caller.call("completions", body, ctx, stream=True)
            where = redact_url(self.caller.url(replica, "completions"))
            stamp = StreamStamp(watch, root_of(replica.base_url), on=None)
            async with contextlib.aclosing(self.caller.events(stream, replica, "completions", ctx)) as events:
                async for chunk in events:
                    if not isinstance(chunk, dict) or chunk.get("object") == "error":
                        raise UpstreamBadResponseError(
                            f"{where} sent a bad stream event: {str(chunk)[:200]}", url=where
                        )
                    if self.config.served_model_name:
                        chunk["model"] = self.config.served_model_name
                    if tokens is not None:
                        for choice in tokens.take(chunk):
                            await tokens.attach(choice, self.caller, replica, ctx, where)
                    stamp.see(chunk)
                    yield chunk
