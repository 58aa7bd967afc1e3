"""``RemoteBackend``: a backend over one remote API, by composition.

An ``upstream.Upstream`` holds what differs between a self-hosted chat server, OpenAI and Azure
(URLs, credentials, HTTP clients, body rules); a ``caller.UpstreamCaller`` calls it (replica pool,
limiter, retries, error translation). Everything else is written here once: the chat endpoint,
streaming, token IDs, client-side parsing, and the Responses API — passed to the upstream's own
when it has one (``Upstream.native_responses``), else through ``responses_over_chat``; the
completions route (``remote_completions``) and ``/tokenize`` (``remote_tokens``) in mixins. The three
registered kinds (``chat``, ``openai``, ``azure``) are this class with a different upstream.

Upstream behaviour followed:

- reasoning arrives as ``message.reasoning_content`` (DeepSeek, vLLM < 0.10) or ``message.reasoning``
  (vLLM ≥ 0.10; gpt-oss always sends it); whichever comes is mirrored into the other name, so
  clients keyed on either keep working.
- token IDs (``return_token_id_information: true``), in vLLM's forms: ``return_token_ids: true``
  (top-level ``prompt_token_ids`` and ``choices[0].token_ids``, vLLM ≥ 0.10.2), ``logprobs: true``
  with ``return_tokens_as_token_ids: true`` (``logprobs.content[].token == "token_id:N"``), and
  ``POST {root}/tokenize`` as the fallback for the prompt. Message-level ``prompt_token_ids``,
  ``generation_token_ids``, ``generation_log_probs`` (another gymserve, NeMo RL) are taken as given.
  The three are put on ``choices[0].message``. Partial or inconsistent metadata raises
  ``UpstreamError`` (502); IDs are never fabricated.
- servers that return raw text (no tool-call/reasoning parser) are parsed here with the same
  parser registry as the local engine (``tool_parser``, ``reasoning_parser`` options).
- an upstream context-window overflow becomes an empty, length-terminated reply on the chat
  endpoint and the empty ``incomplete`` Response on the Responses one (case CL-01).
- a backend that tracks its servers' weight versions (the chat gateway: ``versions``) puts
  ``weight_version`` on every answer, whole and streamed (``chat_versions``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.caller import UpstreamCaller, replica_label
from gymserve.backends.chat_versions import ReplicaVersions, StreamStamp, VersionWatch, root_of, stamp_choices
from gymserve.backends.chat_wire import checked_chunk, completion_to_chunks, normalize_tool_call_arguments
from gymserve.backends.pool import Limiter, ReplicaPool
from gymserve.backends.raw_text import ParsedChunkStream, apply_parsers
from gymserve.backends.remote_completions import RemoteCompletions
from gymserve.backends.remote_tokens import RemoteTokens
from gymserve.backends.responses_over_chat import ChatAnswer, overflow_events
from gymserve.backends.token_stream import StreamedTokens, attach_token_info
from gymserve.backends.upstream import Upstream
from gymserve.convert import (
    ConvertOptions,
    aborted_chat_completion,
    context_exceeded_chat_completion,
    context_exceeded_response,
)
from gymserve.engine.pause_gate import Call, CallAborted, PauseGate
from gymserve.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    UpstreamError,
)
from gymserve.protocol import ChatCompletionDict, ChatRequest, ResponseDict, ResponsesRequest
from gymserve.redaction import redact_url
from gymserve.wire.reasoning import mirror_reasoning

log = logging.getLogger("gymserve.backends")


class RemoteBackend(RemoteCompletions, RemoteTokens, Backend):
    """A remote API (``upstream``) behind the server's routes; see the module docstring.

    ``max_queue`` bounds the requests waiting for one of ``num_concurrent_requests`` slots
    (``OverloadedError`` beyond). Errors: everything upstream becomes a ``GymserveError`` from
    ``upstream_errors.translate_error``. Subclasses only name a kind: ``name`` and ``upstream_type``.
    """

    upstream_type: type[Upstream]
    limiter: Limiter
    gate: PauseGate | None = None  # set by a backend that pauses at its door (chat_control)
    versions: ReplicaVersions | None = None  # set by a backend that knows its servers' weight versions
    pool: ReplicaPool

    def __init__(self, upstream: Upstream, *, max_queue: int = 1024):
        self.upstream = upstream
        self.config = config = upstream.config
        self.caller = UpstreamCaller(upstream, max_queue=max_queue)
        self.limiter = self.caller.limiter
        self.pool = self.caller.pool
        self._wants_token_ids = bool(getattr(config, "return_token_id_information", False))
        self._tool_parser = self._reasoning_parser = None
        if getattr(config, "tool_call_parser", None):
            from gymserve.parsers import tool_call_parser_for

            self._tool_parser = tool_call_parser_for(config.tool_call_parser, model_name=config.model)[0]
        if getattr(config, "reasoning_parser", None):
            from gymserve.parsers import get_reasoning_parser

            self._reasoning_parser = get_reasoning_parser(config.reasoning_parser)

    @classmethod
    def from_config(cls, config: Any, *, max_queue: int = 1024) -> RemoteBackend:
        return cls(cls.upstream_type(config), max_queue=max_queue)

    @property
    def secrets(self) -> tuple[str, ...]:
        return self.upstream.secrets

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "target": self.upstream.target(),
            "model": self.config.model,
            "tool_call_parser": getattr(self._tool_parser, "name", None),
            "reasoning_parser": getattr(self._reasoning_parser, "name", None),
        }

    def convert_options(self) -> ConvertOptions:
        return self.upstream.convert_options()

    # ------------------------------------------------------------------ chat
    def _refuse_token_prefix(self, request: dict[str, Any]) -> None:
        """A cloud API takes no token IDs: ``required_prefix_token_ids`` is a 400 before anything is sent."""
        if self.upstream.cloud and request.get("required_prefix_token_ids") is not None:
            raise InvalidRequestError(
                f"required_prefix_token_ids cannot be honoured by the {self.name} backend: the API takes no token "
                "IDs; leave it out, or serve the policy with the local backend or a chat backend",
                param="required_prefix_token_ids",
            )

    def _chat_body(self, request: ChatRequest) -> dict[str, Any]:
        cfg = self.config
        self._refuse_token_prefix(request)
        body = {**copy.deepcopy(cfg.extra_body), **request}
        body.pop("stream", None)
        body.pop("stream_options", None)
        if cfg.chat_template_kwargs or request.get("chat_template_kwargs"):
            body["chat_template_kwargs"] = {**cfg.chat_template_kwargs, **(request.get("chat_template_kwargs") or {})}
        model = self.upstream.model(request)
        if model:
            body["model"] = model
        if self._wants_token_ids:
            body.update(return_token_ids=True, logprobs=True, return_tokens_as_token_ids=True)
            body.setdefault("top_logprobs", 0)
        if self._tool_parser is not None:  # an upstream that returns the format's raw text
            body = self._tool_parser.adjust_request(body)
        return self.upstream.chat_body(body)

    def _admitted(self) -> contextlib.AbstractAsyncContextManager[Call | None]:
        """Through the pause gate when there is one (held while paused; see ``pause_gate``)."""
        return self.gate.call() if self.gate is not None else contextlib.nullcontext()

    async def _version_watch(self) -> VersionWatch | None:
        """The weight versions as an admitted call starts (``chat_versions``), when tracked."""
        return await self.versions.watch() if self.versions is not None else None

    async def _chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """The upstream completion, post-processed; raises ``ContextLengthExceededError`` on
        overflow. A call an ``abort`` pause ends before the upstream answered gives an empty
        ``finish_reason: "abort"`` completion (nothing was streamed to keep)."""
        body = self._chat_body(request)
        async with self._admitted() as call, self.limiter.slot():
            watch = await self._version_watch()
            work = self.caller.call("chat", body, ctx)
            try:
                completion, replica = await (call.race(work) if call is not None else work)
            except CallAborted:
                aborted = aborted_chat_completion(self.config.served_model_name or body.get("model") or "")
                stamp_choices(watch, aborted, None, on="message")
                return aborted
            choices = completion.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise UpstreamError(
                    f"{redact_url(self.caller.url(replica, 'chat'))} returned a chat completion without choices"
                )
            if self._wants_token_ids:
                await attach_token_info(self.caller, completion, request, body, replica, ctx)
        for choice in choices:
            if isinstance(choice.get("message"), dict):
                mirror_reasoning(choice["message"])
                apply_parsers(choice, request.get("tools"), self._tool_parser, self._reasoning_parser)
                normalize_tool_call_arguments(choice["message"])
        stamp_choices(watch, completion, root_of(replica.base_url), on="message")
        if self.config.served_model_name:
            completion["model"] = self.config.served_model_name
        return completion

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """POST ``{base}/chat/completions``; an upstream context overflow gives an empty
        ``finish_reason: length`` completion (``context_exceeded_chat_completion``)."""
        try:
            return await self._chat(request, ctx)
        except ContextLengthExceededError as exc:
            log.info(
                "context window exceeded upstream; answering with an empty length-terminated reply: %s", exc.message
            )
            return context_exceeded_chat_completion(
                request, self.config.served_model_name or request.get("model") or ""
            )

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Upstream chunks passed through (reasoning field mirrored), their raw text parsed as it
        arrives when ``tool_parser`` / ``reasoning_parser`` are set (``raw_text``). With
        ``return_token_id_information`` the token metadata vLLM streams (``prompt_token_ids`` on
        the first chunk, ``token_ids`` and ``logprobs`` on each) is collected and the training
        fields ride on the finish chunk's delta, as on the local engine's stream; an overflow gives
        the chunks of the empty length-terminated completion."""
        tokens = (
            StreamedTokens(bool(request.get("logprobs")), bool(request.get("return_token_ids")))
            if self._wants_token_ids
            else None
        )
        parsed = None
        if self._tool_parser or self._reasoning_parser:
            parsed = ParsedChunkStream(request.get("tools"), self._tool_parser, self._reasoning_parser)
        plain_body = self._chat_body(request)  # also what /tokenize renders, if the prompt IDs are missing
        body = {**plain_body, "stream": True}
        if request.get("stream_options"):
            body["stream_options"] = request["stream_options"]
        async with self._admitted() as call, self.limiter.slot():
            watch = await self._version_watch()
            try:
                work = self.caller.call("chat", body, ctx, stream=True)
                stream, replica = await (call.race(work) if call is not None else work)
            except ContextLengthExceededError:
                for chunk in completion_to_chunks(
                    context_exceeded_chat_completion(request, request.get("model") or "")
                ):
                    yield chunk
                return
            except CallAborted:
                stamp = StreamStamp(watch, None, on="delta")
                for chunk in completion_to_chunks(
                    aborted_chat_completion(self.config.served_model_name or body.get("model") or "")
                ):
                    stamp.see(chunk)
                    yield chunk
                return
            where = redact_url(self.caller.url(replica, "chat"))
            stamp = StreamStamp(watch, root_of(replica.base_url), on="delta")
            last: dict[str, Any] = {}
            call_index: dict[tuple[int, str], int] = {}  # (choice, call id) -> index, for servers that omit it
            async with contextlib.aclosing(self.caller.events(stream, replica, "chat", ctx)) as events:
                async for chunk in call.until_aborted(events) if call is not None else events:
                    chunk = checked_chunk(chunk, where, call_index)
                    if self.config.served_model_name:
                        chunk["model"] = self.config.served_model_name
                    if tokens is not None:
                        tokens.take(chunk)
                    last = chunk
                    for piece in parsed.process(chunk) if parsed is not None else [chunk]:
                        if tokens is not None:
                            for index in tokens.finishing(piece):
                                await attach_token_info(
                                    self.caller, tokens.completion(piece, index), request, plain_body, replica, ctx
                                )
                        stamp.see(piece)
                        yield piece
            if call is not None and call.aborted.is_set() and not (tokens is not None and tokens.finished):
                # An abort pause ended the stream: what was streamed stays, and the call ends
                # like an aborted call on the local engine (finish_reason "abort", training fields).
                piece = abort_chunk(last, self.config.served_model_name or body.get("model") or "")
                if tokens is not None:
                    done = tokens.completion(piece)
                    done["choices"][0].setdefault("token_ids", [])
                    done["choices"][0].setdefault("logprobs", {"content": []})
                    await attach_token_info(self.caller, done, request, plain_body, replica, ctx)
                stamp.see(piece)
                yield piece
                return

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The upstream's completion for the Responses path, which answers an overflow itself
        (``ContextLengthExceededError`` propagates)."""
        return ChatAnswer.of_completion(await self._chat(request, ctx))

    async def upstream_models(self, ctx: RequestContext | None = None) -> list[str]:
        """IDs from ``GET {base}/models`` of one replica (raises the translated error)."""
        result, _ = await self.caller.call("models", None, ctx or RequestContext())
        return [str(m["id"]) for m in result.get("data") or [] if isinstance(m, dict) and m.get("id")]

    async def models(self) -> list[str]:
        name = self.config.served_model_name or self.config.model
        return [name] if name else await self.upstream_models()

    async def health(self) -> dict[str, Any]:
        """The pool's status (``ReplicaPool.status``: ok / degraded / down, per replica its URL,
        health, last probe time and last error) once the first probe round is in; URLs without
        credentials. ``probe`` names what is asked of each replica."""
        pool = self.caller.pool
        await pool.first_probe(self.caller.probe_timeout)
        status = pool.status()
        for row in status["replicas"]:
            row["base_url"] = replica_label(row["base_url"])
        probe = "GET {base_url}/models" if pool.probing else None
        return {**status, "backend": self.name, "probe": probe}

    async def close(self) -> None:
        await self.caller.close()

    # ------------------------------------------------------------------ Responses API
    async def responses(self, request: ResponsesRequest, ctx: RequestContext) -> ResponseDict:
        """Native Responses API: POST the request to ``{base}/responses`` (``Upstream.responses_body``:
        ``model`` replaced, training fields and ``stream`` removed); an upstream context overflow
        gives ``context_exceeded_response``. Otherwise ``responses_over_chat``."""
        if not self.upstream.native_responses:
            return await super().responses(request, ctx)
        self._refuse_token_prefix(request)
        try:
            async with self.limiter.slot():
                response, _ = await self.caller.call("responses", self.upstream.responses_body(request), ctx)
        except ContextLengthExceededError as exc:
            log.info("context window exceeded upstream; answering with an empty incomplete response: %s", exc.message)
            return context_exceeded_response(request)
        if self.config.served_model_name:
            response["model"] = self.config.served_model_name
        return response

    def responses_stream(self, request: ResponsesRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Native Responses API: the upstream's own event stream, passed through (an error before
        the first event raises: a plain 4xx/5xx; an overflow yields ``overflow_events``).
        Otherwise ``responses_over_chat``."""
        if not self.upstream.native_responses:
            return super().responses_stream(request, ctx)
        self._refuse_token_prefix(request)
        return self._native_responses_stream(request, ctx)

    def _native_responses_stream(self, request: ResponsesRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        body = {**self.upstream.responses_body(request), "stream": True}
        return self._native_stream(
            "responses", body, ctx, lambda: overflow_events(request), lambda e: e.get("response")
        )

    async def _native_stream(
        self,
        kind: str,
        body: dict[str, Any],
        ctx: RequestContext,
        overflow: Callable[[], list[dict[str, Any]]],
        named: Callable[[dict[str, Any]], Any],
    ) -> AsyncIterator[dict[str, Any]]:
        """An upstream's own event stream for ``body`` on its ``kind`` API, passed through: an error
        before the first event raises (a plain 4xx/5xx), a context-window overflow yields
        ``overflow()``, and ``named(event)`` — the object in an event that names the model, if any —
        gets ``served_model_name``."""
        async with self.limiter.slot():
            try:
                stream, replica = await self.caller.call(kind, body, ctx, stream=True)
            except ContextLengthExceededError:
                for event in overflow():
                    yield event
                return
            async with contextlib.aclosing(
                self.caller.events(stream, replica, kind, ctx, require_events=False)
            ) as events:
                async for event in events:
                    holder = named(event) if self.config.served_model_name and isinstance(event, dict) else None
                    if isinstance(holder, dict):
                        holder["model"] = self.config.served_model_name
                    yield event


def abort_chunk(last: dict[str, Any], model: str) -> dict[str, Any]:
    """The chunk that ends a stream an ``abort`` pause cut: ``finish_reason: "abort"``, an empty
    delta, the stream's ``id`` and ``created``."""
    from gymserve.wire.ids import new_id

    return {
        "id": last.get("id") or new_id("chatcmpl"),
        "object": "chat.completion.chunk",
        "created": last.get("created") or int(time.time()),
        "model": last.get("model") or model,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "abort", "logprobs": None}],
    }
