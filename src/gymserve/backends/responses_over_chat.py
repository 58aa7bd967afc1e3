"""The Responses API over a backend's Chat Completions: convert → chat → convert back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gymserve.protocol import ResponseDict, ResponsesRequest

if TYPE_CHECKING:
    from gymserve.backends.base import Backend, RequestContext


async def responses_over_chat(backend: Backend, request: ResponsesRequest, ctx: RequestContext) -> ResponseDict:
    """Convert → ``chat`` → convert back. A prompt that fills the context window ends the
    rollout cleanly on every backend (case CL-01): an empty Response with status
    ``incomplete``, not an error (the chat endpoint of the local backend keeps its 400)."""
    from gymserve.convert import chat_to_response, context_exceeded_response, responses_to_chat
    from gymserve.errors import ContextLengthExceededError

    request = backend.fill_responses_defaults(request)
    chat_request = responses_to_chat(request, backend.convert_options())
    try:
        completion = await backend.chat(chat_request, ctx)
    except ContextLengthExceededError:
        return context_exceeded_response(request)
    return chat_to_response(completion, request)


async def responses_stream_over_chat(backend: Backend, request: ResponsesRequest,
                                     ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
    """Responses streaming events built from the chat stream (``convert.stream.ResponseStreamBuilder``).

    The first chat chunk is awaited before ``response.created`` is yielded, so a request the
    backend rejects fails as a plain 4xx rather than as an event inside a 200 stream.
    """
    from gymserve.backends.chat_wire import completion_to_chunks
    from gymserve.convert import context_exceeded_chat_completion, responses_to_chat
    from gymserve.convert.stream import ResponseStreamBuilder
    from gymserve.errors import ContextLengthExceededError, GymserveError

    request = backend.fill_responses_defaults(request)
    chat_request = responses_to_chat(request, backend.convert_options())
    chat_request["stream"] = True
    chat_request["stream_options"] = {"include_usage": True}
    chunks: AsyncIterator[dict[str, Any]] | None = aiter(backend.chat_stream(chat_request, ctx))
    try:
        first = await anext(chunks, None)
        replay = [first] if first is not None else []
    except ContextLengthExceededError:
        # As in ``responses``: the chunks of the empty, length-terminated completion (CL-01).
        chunks, replay = None, completion_to_chunks(context_exceeded_chat_completion(chat_request, ""))
    builder = ResponseStreamBuilder(request)
    for event in builder.start():
        yield event
    try:
        for chunk in replay:
            for event in builder.feed(chunk):
                yield event
        if chunks is not None:
            async for chunk in chunks:
                for event in builder.feed(chunk):
                    yield event
        events = builder.finish()  # may find the upstream's token fields unusable
    except GymserveError as exc:
        for event in builder.fail(exc.message):
            yield event
        return
    for event in events:
        yield event
