"""The backend contract: everything the server (and ``gymserve check``) may use of a backend.

``chat`` answers a Chat Completions request; ``responses`` answers a Responses request and
``messages`` an Anthropic Messages request, by default by converting to chat and back (Responses-
native clouds override ``responses``, the Anthropic backend ``messages``). Streaming variants yield
already-shaped chunks/events. Replica pools, session affinity, retries and concurrency limits live
in the backends, once. Nothing outside ``gymserve.backends`` (and ``gymserve.ray_cluster``) reads
a backend attribute this class does not declare.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from gymserve.backends.context import RequestContext
from gymserve.backends.messages_over_chat import messages_over_chat, messages_stream_over_chat
from gymserve.backends.responses_over_chat import ChatAnswer, responses_over_chat, responses_stream_over_chat
from gymserve.protocol import (
    ChatCompletionDict,
    ChatRequest,
    MessageDict,
    MessagesRequest,
    ResponseDict,
    ResponsesRequest,
)

__all__ = ["Backend", "RequestContext"]

if TYPE_CHECKING:
    from gymserve.backends.pool import Limiter, ReplicaPool
    from gymserve.control import Control
    from gymserve.convert import ConvertOptions


class Backend(ABC):
    """One kind of upstream behind the server's routes.

    An abstract base class rather than a ``typing.Protocol``: the Responses methods have one shared
    implementation (``backends.responses_over_chat``) that backends inherit instead of copying, and
    a backend missing a method fails when it is built (``TypeError`` naming the method) rather than
    on the first request that needs it.

    Declared state: ``name`` (the registry name: ``/health``, metrics labels, logs); ``limiter``
    (the ``pool.Limiter`` bounding calls in flight, read by the queue-depth metrics; None when the
    backend has none); ``pool`` (the ``pool.ReplicaPool`` routing its calls across replicas, read by
    the per-replica metrics; None without one); ``secrets`` (credentials the server must redact from
    logs and capture); ``control`` (the ``gymserve.control.Control`` of what owns the weights or
    the servers: pause, weight updates, LoRA, status; None for a backend serving weights it does
    not own, whose control routes then answer 501 through ``gymserve.control.control_of``). This
    class is the data path only: it declares no control verb.

    Errors: every method raises ``gymserve.errors.GymserveError`` subclasses only; the server turns
    them into OpenAI error objects with their status.
    """

    name: ClassVar[str] = "backend"
    limiter: Limiter | None = None
    pool: ReplicaPool | None = None
    control: Control | None = None

    @classmethod
    @abstractmethod
    def from_config(cls, config: Any, *, max_queue: int) -> Backend:
        """Build the backend from its config model (``gymserve.config``: the ``backend`` section);
        ``max_queue`` bounds the requests waiting for a slot (``OverloadedError``, 429, beyond).
        ``build_backend`` calls it through the ``BACKENDS`` registry."""

    @property
    def secrets(self) -> tuple[str, ...]:
        """Credential values (API keys, tokens) to replace by ``***`` wherever the server writes text."""
        return ()

    # ---- Chat Completions ----------------------------------------------------------------------

    @abstractmethod
    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """A ``ChatCompletion`` dict (training fields on ``choices[0].message``) for ``request``."""

    @abstractmethod
    def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """``ChatCompletionChunk`` dicts for ``request``; the training fields ride on the finish chunk."""

    # ---- Responses API -------------------------------------------------------------------------

    async def responses(self, request: ResponsesRequest, ctx: RequestContext) -> ResponseDict:
        """A ``Response`` dict: by default convert → ``answer`` → convert back (see
        ``responses_over_chat``); a prompt that fills the context window gives the empty
        ``incomplete`` Response (case CL-01)."""
        return await responses_over_chat(self, request, ctx)

    def responses_stream(self, request: ResponsesRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Responses streaming events: by default built from ``chat_stream`` (see
        ``responses_over_chat``). The first chat chunk is awaited before ``response.created`` is
        yielded, so a request the backend rejects fails as a plain 4xx, not inside a 200 stream."""
        return responses_stream_over_chat(self, request, ctx)

    # ---- Anthropic Messages API ----------------------------------------------------------------

    async def messages(self, request: MessagesRequest, ctx: RequestContext) -> MessageDict:
        """An Anthropic ``Message`` dict (training fields beside ``content``): by default convert →
        ``answer`` → convert back (see ``messages_over_chat``); a prompt that fills the context
        window gives the empty Message with ``stop_reason: model_context_window_exceeded``."""
        return await messages_over_chat(self, request, ctx)

    def messages_stream(self, request: MessagesRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Messages streaming events (``message_start`` … ``message_stop``): by default built from
        ``chat_stream`` (see ``messages_over_chat``); the first chat chunk is awaited first, so a
        rejected request fails as a plain 4xx."""
        return messages_stream_over_chat(self, request, ctx)

    async def count_tokens(self, request: MessagesRequest, ctx: RequestContext) -> int:
        """The prompt tokens a Messages request (``POST /v1/messages/count_tokens``: no
        ``max_tokens``) would have, as generation would see them. Raises ``NotSupportedError`` (501)
        by default (after the request is checked, so bad input is still a 400): only a backend
        that holds the tokenizer (local) or an upstream that counts (anthropic) can answer."""
        from gymserve.convert.messages_to_chat import messages_to_chat
        from gymserve.errors import NotSupportedError

        messages_to_chat(request, self.convert_options(), count_only=True)
        raise NotSupportedError(
            f"POST /v1/messages/count_tokens is not supported by the {self.name} backend: it does not hold the "
            "model's tokenizer. Use the local backend (backend.type: local), or an anthropic backend, whose "
            "upstream counts",
            code="count_tokens_not_supported",
        )

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The whole answer to a chat request, for the Responses path: ``chat``'s completion by
        default; the local engine (and Ray) give its chunks, which keep the generation order. Raises
        ``ContextLengthExceededError`` when the prompt does not fit (answered with the empty
        ``incomplete`` Response), where ``chat`` may answer otherwise."""
        return ChatAnswer.of_completion(await self.chat(request, ctx))

    def fill_responses_defaults(self, request: ResponsesRequest) -> ResponsesRequest:
        """The request as this backend will run it, so the Response echoes the real parameters
        (e.g. the server's pinned temperature). Default: unchanged."""
        return request

    def convert_options(self) -> ConvertOptions:
        """How this backend wants Responses requests rendered as chat (``gymserve.convert.ConvertOptions``)."""
        from gymserve.convert import ConvertOptions

        return ConvertOptions()

    # ---- Completions (legacy, for base models) and tokenization -------------------------------

    async def completions(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """A ``Completion`` dict (training fields on each choice) for a ``/v1/completions`` request
        already checked by ``convert.completions_request``. Raises ``NotSupportedError`` (501) by
        default."""
        raise self._not_served("POST /v1/completions")

    def completions_stream(self, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """``Completion`` chunk dicts for a streamed ``/v1/completions`` request; the training fields
        ride on each choice's finish chunk. Raises ``NotSupportedError`` (501) by default."""
        raise self._not_served("POST /v1/completions")

    async def tokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``POST /tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}`` for a
        prompt or chat messages, as generation would see them. ``NotSupportedError`` (501) by default."""
        raise self._not_served("POST /tokenize")

    async def detokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``POST /detokenize``: ``{"prompt": text}`` for ``tokens``. ``NotSupportedError``
        (501) by default."""
        raise self._not_served("POST /detokenize")

    async def generate_tokens(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``POST /inference/v1/generate`` (token IDs in, token IDs and log-probs out; see
        ``backends.local.tokens_in``). ``NotSupportedError`` (501) by default."""
        raise self._not_served("POST /inference/v1/generate")

    async def sglang_generate(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any] | list[Any]:
        """SGLang's ``POST /generate`` (``input_ids`` in; ``output_ids`` and ``meta_info``'s
        log-probs out; see ``backends.local.tokens_in``). ``NotSupportedError`` (501) by default."""
        raise self._not_served("POST /generate")

    def _not_served(self, route: str):
        from gymserve.errors import NotSupportedError

        return NotSupportedError(
            f"{route} is not served by the {self.name} backend; use the local backend, or a chat backend "
            "whose upstream serves it (vLLM, SGLang, another gymserve)",
            code="route_not_supported",
        )

    # ---- models, health, lifetime --------------------------------------------------------------

    @abstractmethod
    async def models(self) -> list[str]:
        """Model names this backend serves (for ``GET /v1/models``)."""

    async def upstream_models(self) -> list[str]:
        """What the upstream itself lists (remote backends: ``GET {base}/models`` of one replica,
        raising the translated error); ``gymserve check`` probes it. Default: ``models()``."""
        return await self.models()

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Static facts for ``/health``, the start-up banner and ``gymserve check``: at least
        ``backend`` (the name) and ``target`` (what it serves from, credentials removed); the local
        engine adds ``model``, ``tool_call_parser`` (+ ``_reason``), ``reasoning_parser``..."""

    async def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded" | "down", ...details}``. Default: ok with ``describe()``."""
        return {"status": "ok", **self.describe()}

    async def close(self) -> None:
        """Release clients, engines and background tasks (idempotent)."""
        return None
