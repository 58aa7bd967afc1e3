"""The Anthropic Messages API over a backend's Chat Completions, written once: convert → chat →
convert back, as ``responses_over_chat`` serves the Responses API.

Every backend without a native Messages API (local, ray, chat, openai, azure) serves
``/v1/messages`` through these functions (``Backend.messages`` / ``messages_stream`` call them):

- the request rendered as chat by ``convert.messages_to_chat`` with ``backend.convert_options()``;
- non-streamed: ``backend.answer(chat_request)`` is the whole chat answer; its chunks (local
  engine, Ray) go through the same ``MessageStreamBuilder`` as a stream would, so the Message is the
  streamed one's final state; a remote completion through ``chat_to_response`` →
  ``response_to_message``;
- streamed: ``backend.chat_stream`` fed to ``convert.messages_stream.MessageStreamBuilder``; the
  first chat chunk is awaited before ``message_start``, so a request the backend rejects fails as a
  plain 4xx in Anthropic's error shape, not inside a 200 stream; a failure after that ends the
  stream with an ``error`` event;
- an ``InvalidRequestError`` about the chat request (the local engine's checks, the template's, the
  prefix splice's) is told in the Messages request's fields (``convert.field_paths``: the system
  prompt and merged turns shift the chat messages' indices);
- a prompt that fills the context window (``ContextLengthExceededError``): the empty Message with
  ``stop_reason: model_context_window_exceeded`` (``chat_to_messages.context_exceeded_message``),
  so the rollout ends cleanly (case CL-01).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from gymserve.backends.context import RequestContext
from gymserve.backends.responses_over_chat import ChatAnswer, ChatSide, built_events
from gymserve.convert import chat_to_response
from gymserve.convert.chat_to_messages import context_exceeded_message, matched_stop_sequence, response_to_message
from gymserve.convert.field_paths import MESSAGES, FieldPaths
from gymserve.convert.messages_stream import MessageStreamBuilder, context_exceeded_events
from gymserve.convert.messages_to_chat import messages_to_chat
from gymserve.errors import ContextLengthExceededError, InvalidRequestError
from gymserve.protocol import ChatRequest, MessageDict, MessagesRequest

log = logging.getLogger("gymserve.backends")


def _stop_sequences(request: MessagesRequest) -> list[str]:
    stops = request.get("stop_sequences")
    return [s for s in stops if isinstance(s, str)] if isinstance(stops, list) else []


def _as_chat(backend: ChatSide, request: MessagesRequest) -> tuple[ChatRequest, FieldPaths]:
    paths = FieldPaths(MESSAGES)
    return messages_to_chat(request, backend.convert_options(), paths), paths


def answer_to_message(answer: ChatAnswer, request: MessagesRequest) -> MessageDict:
    """The ``Message`` for one whole chat answer to ``request`` (see the module docstring)."""
    stops = _stop_sequences(request)
    model = request.get("model") or ""
    if answer.completion is not None:
        choice = (answer.completion.get("choices") or [None])[0]
        response = chat_to_response(answer.completion, {"model": model})
        return response_to_message(response, stop_sequence=matched_stop_sequence(choice, stops))
    builder = MessageStreamBuilder(model, stop_sequences=stops)
    for chunk in answer.chunks or ():
        builder.feed(chunk)
    builder.finish()
    assert builder.message is not None  # finish() always sets it
    return builder.message


async def messages_over_chat(backend: ChatSide, request: MessagesRequest, ctx: RequestContext) -> MessageDict:
    """Convert → ``backend.answer`` → convert back; an overflow gives ``context_exceeded_message``."""
    chat_request, paths = _as_chat(backend, request)
    try:
        answer = await backend.answer(chat_request, ctx)
    except ContextLengthExceededError as exc:
        log.info("context window exceeded; answering with an empty Message: %s", exc.message)
        return context_exceeded_message(request.get("model") or "")
    except InvalidRequestError as exc:  # named with the chat request's fields: tell them in the caller's
        raise paths.translate(exc) from None
    return answer_to_message(answer, request)


async def messages_stream_over_chat(
    backend: ChatSide, request: MessagesRequest, ctx: RequestContext
) -> AsyncIterator[dict[str, Any]]:
    """Messages streaming events built from ``backend.chat_stream`` (see the module docstring)."""
    chat_request, paths = _as_chat(backend, request)
    chat_request = {**chat_request, "stream": True, "stream_options": {"include_usage": True}}
    chunks = aiter(backend.chat_stream(chat_request, ctx))
    try:
        first = await anext(chunks, None)
    except ContextLengthExceededError as exc:
        log.info("context window exceeded; answering with an empty Message: %s", exc.message)
        for event in context_exceeded_events(request.get("model") or ""):
            yield event
        return
    except InvalidRequestError as exc:
        raise paths.translate(exc) from None
    model = (first.get("model") if isinstance(first, dict) else None) or request.get("model") or ""
    builder = MessageStreamBuilder(model, stop_sequences=_stop_sequences(request))
    async for event in built_events(builder, first, chunks, lambda exc: builder.fail(exc.status_code, exc.message)):
        yield event
