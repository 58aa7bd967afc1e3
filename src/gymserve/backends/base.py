"""The backend interface: one class per kind of upstream, one shape.

``chat`` answers a Chat Completions request; ``responses`` answers a Responses request, by default
by converting to chat and back (Responses-native clouds override it). Streaming variants yield
already-shaped chunks/events. Replica pools, session affinity, retries and concurrency limits live
in the backends, once.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gymserve.protocol import ChatCompletionDict, ChatRequest, ResponseDict, ResponsesRequest


@dataclass
class RequestContext:
    """Per-request facts that are not part of the OpenAI body.

    ``session_id``: from the ``X-Session-ID`` header or the session cookie; routes a rollout's turns
    to one replica. ``request_id``: for logs and capture.
    """

    session_id: str | None = None
    request_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Backend:
    """Base class. Subclasses implement ``chat`` (and ``chat_stream``); the Responses methods default
    to convert → chat → convert back via ``gymserve.convert``."""

    name: str = "backend"

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        raise NotImplementedError

    def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Yield ``ChatCompletionChunk``-shaped dicts."""
        raise NotImplementedError

    async def responses(self, request: ResponsesRequest, ctx: RequestContext) -> ResponseDict:
        """Convert → ``chat`` → convert back. A prompt that fills the context window ends the
        rollout cleanly on every backend (case CL-01): an empty Response with status
        ``incomplete``, not an error (the chat endpoint of the local backend keeps its 400)."""
        from gymserve.convert import chat_to_response, context_exceeded_response, responses_to_chat
        from gymserve.errors import ContextLengthExceededError

        request = self.fill_responses_defaults(request)
        chat_request = responses_to_chat(request, self.convert_options())
        try:
            completion = await self.chat(chat_request, ctx)
        except ContextLengthExceededError:
            return context_exceeded_response(request)
        return chat_to_response(completion, request)

    async def responses_stream(self, request: ResponsesRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Responses streaming events built from the chat stream (``convert.stream.ResponseStreamBuilder``).

        The first chat chunk is awaited before ``response.created`` is yielded, so a request the
        backend rejects fails as a plain 4xx rather than as an event inside a 200 stream.
        """
        from gymserve.backends.chat_wire import completion_to_chunks
        from gymserve.convert import context_exceeded_chat_completion, responses_to_chat
        from gymserve.convert.stream import ResponseStreamBuilder
        from gymserve.errors import ContextLengthExceededError, GymserveError

        request = self.fill_responses_defaults(request)
        chat_request = responses_to_chat(request, self.convert_options())
        chat_request["stream"] = True
        chat_request["stream_options"] = {"include_usage": True}
        chunks: AsyncIterator[dict[str, Any]] | None = aiter(self.chat_stream(chat_request, ctx))
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

    def fill_responses_defaults(self, request: ResponsesRequest) -> ResponsesRequest:
        """The request as this backend will run it, so the Response echoes the real parameters
        (e.g. the server's pinned temperature). Default: unchanged."""
        return request

    def convert_options(self):
        """How this backend wants Responses requests rendered as chat (``gymserve.convert.ConvertOptions``)."""
        from gymserve.convert import ConvertOptions

        return ConvertOptions()

    async def models(self) -> list[str]:
        """Model names this backend serves (for ``GET /v1/models``)."""
        raise NotImplementedError

    async def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded" | "down", ...details}``."""
        return {"status": "ok"}

    # ---- control plane of a policy being trained (server.control; vLLM's names) ---------------

    def _no_control(self, what: str):
        from gymserve.errors import NotSupportedError

        return NotSupportedError(
            f"{what} is not supported by the {self.name} backend yet: it serves weights it does not own. "
            "Use the local backend (backend.type: local) for weight updates and pauses in gymserve, or "
            "drive your upstream server's own control API", code="control_not_supported")

    async def pause_generation(self, mode: str = "abort", *, timeout: float | None = None) -> None:
        """Pause in ``mode`` (``abort`` | ``wait`` | ``keep``) for at most ``timeout`` s; see
        docs/concepts/training-control.md. Raises ``NotSupportedError`` (501) by default."""
        raise self._no_control("pause_generation")

    async def resume_generation(self) -> None:
        """End a pause. Raises ``NotSupportedError`` (501) by default."""
        raise self._no_control("resume_generation")

    async def is_paused(self) -> bool:
        """Whether generation is paused. Raises ``NotSupportedError`` (501) by default."""
        raise self._no_control("is_paused")

    async def update_weights(self, tensors: Any = None, *, path: str | None = None,
                             weight_version: int | str | None = None) -> int | str:
        """Swap in a state dict (``tensors``) or the safetensors under ``path``, all or nothing;
        returns the new weight version. Raises ``NotSupportedError`` (501) by default."""
        raise self._no_control("update_weights")

    async def update_weight_version(self, new_version: int | str) -> None:
        """Name the serving weights ``new_version``. Raises ``NotSupportedError`` (501) by default."""
        raise self._no_control("update_weight_version")

    async def load_lora_adapter(self, lora_name: str, lora_path: str | os.PathLike | None = None, *,
                                tensors: Mapping[str, Any] | None = None, config: Any = None,
                                load_inplace: bool = False, weight_version: int | str | None = None) -> int | str:
        """Merge a LoRA adapter (PEFT format; see ``engine.lora``); returns the new weight version.
        Raises ``NotSupportedError`` (501) by default."""
        raise self._no_control("load_lora_adapter")

    async def unload_lora_adapter(self, lora_name: str, *, weight_version: int | str | None = None) -> int | str:
        """Remove the LoRA adapter ``lora_name``; returns the new weight version. Raises
        ``NotSupportedError`` (501) by default."""
        raise self._no_control("unload_lora_adapter")

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded LoRA adapters (``[]`` by default)."""
        return []

    def control_status(self) -> list[dict[str, Any]]:
        """Per replica ``{"replica", "weight_version", "weight_updates", "paused", ...}`` for
        ``/health`` and ``/metrics``; empty for a backend without weights of its own."""
        return []

    async def close(self) -> None:
        return None
