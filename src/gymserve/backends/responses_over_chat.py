"""The Responses API over a backend's Chat Completions, written once: convert → chat → convert back.

Every backend without a native Responses API (local, ray, chat, azure ``api: chat``) serves
``/v1/responses`` through these two functions (``Backend.responses`` / ``responses_stream`` call
them), and the Responses-native ones (openai, azure ``api: responses``) share their answers to a
context-window overflow:

- the request as run: ``backend.fill_responses_defaults`` (e.g. the server's sampling params, so the
  Response echoes what ran) rendered as chat with ``backend.convert_options()``;
- non-streamed: ``backend.answer(chat_request)`` is the whole chat answer (:class:`ChatAnswer`),
  turned into the Response by ``ChatAnswer.response``;
- streamed: ``backend.chat_stream`` fed to ``convert.ResponseStreamBuilder``;
- a prompt that fills the context window (``ContextLengthExceededError``, from the local engine or
  an upstream alike): the empty ``incomplete`` Response (``convert.context_exceeded_response``) or
  its events (:func:`overflow_events`), so the rollout ends cleanly instead of failing or retrying
  (case CL-01).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gymserve.backends.chat_wire import completion_to_chunks
from gymserve.backends.context import RequestContext
from gymserve.convert import (
    ChunkAccumulator,
    ConvertOptions,
    ResponseStreamBuilder,
    chat_to_response,
    context_exceeded_chat_completion,
    context_exceeded_response,
    responses_to_chat,
)
from gymserve.convert.field_paths import FieldPaths
from gymserve.errors import ContextLengthExceededError, GymserveError, InvalidRequestError
from gymserve.protocol import ChatCompletionDict, ChatRequest, ResponseDict, ResponsesRequest
from gymserve.wire.reasoning import REASONING_FIELDS, ReasoningField

log = logging.getLogger("gymserve.backends")


@dataclass(frozen=True)
class ChatAnswer:
    """One whole chat answer, in the form the backend has it.

    ``chunks``: ``ChatCompletionChunk`` dicts as the local engine (and a Ray replica) stream them —
    they keep the order the model wrote things in (text after a tool call stays after it), which a
    ``ChatCompletion`` cannot say. ``completion``: a remote server's ``ChatCompletion``. Exactly one
    is set (:meth:`of_chunks`, :meth:`of_completion`). ``reasoning_field``: the message field that
    holds reasoning in :meth:`as_completion` (the local backend's ``reasoning_field``).
    """

    chunks: list[dict[str, Any]] | None = None
    completion: ChatCompletionDict | None = None
    reasoning_field: ReasoningField = REASONING_FIELDS[0]

    @classmethod
    def of_chunks(
        cls, chunks: list[dict[str, Any]], *, reasoning_field: ReasoningField = REASONING_FIELDS[0]
    ) -> ChatAnswer:
        return cls(chunks=chunks, reasoning_field=reasoning_field)

    @classmethod
    def of_completion(cls, completion: ChatCompletionDict) -> ChatAnswer:
        return cls(completion=completion)

    def as_completion(self) -> ChatCompletionDict:
        """The ``ChatCompletion`` dict: the completion itself, or the chunks folded
        (``convert.ChunkAccumulator``): what the stream said, as the non-streamed answer says it."""
        if self.completion is not None:
            return self.completion
        accumulator = ChunkAccumulator()
        for chunk in self.chunks or ():
            accumulator.add(chunk)
        return accumulator.completion(reasoning_field=self.reasoning_field)

    def response(self, request: ResponsesRequest) -> ResponseDict:
        """The ``Response`` for ``request``. Chunks go through ``ResponseStreamBuilder`` (so the
        non-streamed Response is the streamed one's final state); a completion through
        ``chat_to_response``, where the builder ends too. Raises ``UpstreamError`` /
        ``InvalidRequestError`` for a completion without choices or with inconsistent token fields."""
        if self.completion is not None:
            return chat_to_response(self.completion, request)
        builder = ResponseStreamBuilder(request)
        for chunk in self.chunks or ():
            builder.feed(chunk)
        builder.finish()
        assert builder.response is not None  # finish() always sets it
        return builder.response


class ChatSide(Protocol):
    """What the Responses path uses of a backend (``base.Backend`` declares all of it)."""

    def fill_responses_defaults(self, request: ResponsesRequest) -> ResponsesRequest: ...

    def convert_options(self) -> ConvertOptions: ...

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer: ...

    def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]: ...


def _as_chat(backend: ChatSide, request: ResponsesRequest) -> tuple[ResponsesRequest, ChatRequest, FieldPaths]:
    request = backend.fill_responses_defaults(request)
    paths = FieldPaths()
    return request, responses_to_chat(request, backend.convert_options(), paths), paths


def overflow_events(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The streaming events of ``convert.context_exceeded_response`` (created, in_progress,
    incomplete): the Responses answer to a prompt that fills the context window (case CL-01)."""
    builder = ResponseStreamBuilder(request)
    events = builder.start()
    for chunk in completion_to_chunks(context_exceeded_chat_completion({}, request.get("model") or "")):
        events += builder.feed(chunk)
    return events + builder.finish()


async def responses_over_chat(backend: ChatSide, request: ResponsesRequest, ctx: RequestContext) -> ResponseDict:
    """Convert → ``backend.answer`` → convert back; an overflow gives
    ``convert.context_exceeded_response`` (the chat endpoint of the local backend keeps its 400)."""
    request, chat_request, paths = _as_chat(backend, request)
    try:
        answer = await backend.answer(chat_request, ctx)
    except ContextLengthExceededError as exc:
        log.info("context window exceeded; answering with an empty incomplete response: %s", exc.message)
        return context_exceeded_response(request)
    except InvalidRequestError as exc:  # named with the chat request's fields: tell them in the caller's
        raise paths.translate(exc) from None
    return answer.response(request)


async def responses_stream_over_chat(
    backend: ChatSide, request: ResponsesRequest, ctx: RequestContext
) -> AsyncIterator[dict[str, Any]]:
    """Responses streaming events built from ``backend.chat_stream`` (``ResponseStreamBuilder``).

    The first chat chunk is awaited before ``response.created`` is yielded, so a request the
    backend rejects fails as a plain 4xx rather than as an event inside a 200 stream; an overflow
    gives :func:`overflow_events`. A failure after the first event ends the stream with
    ``response.failed``.
    """
    request, chat_request, paths = _as_chat(backend, request)
    chat_request = {**chat_request, "stream": True, "stream_options": {"include_usage": True}}
    chunks = aiter(backend.chat_stream(chat_request, ctx))
    try:
        first = await anext(chunks, None)
    except ContextLengthExceededError as exc:
        log.info("context window exceeded; answering with an empty incomplete response: %s", exc.message)
        for event in overflow_events(request):
            yield event
        return
    except InvalidRequestError as exc:
        raise paths.translate(exc) from None
    builder = ResponseStreamBuilder(request)
    async for event in built_events(builder, first, chunks, lambda exc: builder.fail(exc.message)):
        yield event


class StreamBuilder(Protocol):
    """What :func:`built_events` drives: ``ResponseStreamBuilder``, ``MessageStreamBuilder``."""

    def start(self) -> list[dict[str, Any]]: ...

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...


async def built_events(
    builder: StreamBuilder,
    first: dict[str, Any] | None,
    chunks: AsyncIterator[dict[str, Any]],
    fail: Callable[[GymserveError], list[dict[str, Any]]],
) -> AsyncIterator[dict[str, Any]]:
    """A stream builder's events for ``first`` and the rest of ``chunks``: its start, what each chunk
    adds, its finish; a ``GymserveError`` on the way (or in ``finish``, which may find the
    upstream's token fields unusable) ends the stream with ``fail(exc)`` instead."""
    for event in builder.start():
        yield event
    try:
        if first is not None:
            for event in builder.feed(first):
                yield event
            async for chunk in chunks:
                for event in builder.feed(chunk):
                    yield event
        events = builder.finish()
    except GymserveError as exc:
        for event in fail(exc):
            yield event
        return
    for event in events:
        yield event
