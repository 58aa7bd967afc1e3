"""``LocalBackend``: one in-process engine, token-exact (chat template → prompt token IDs → engine
→ parsers → chunks).

Everything that makes a model call usable for on-policy training happens in this package,
engine-independent, one role per module: ``request`` (the request as one engine call: the on-policy
prefix splice via ``gymserve.prompting``, sampling params pinned to the server config, the
context-window clamp, what is refused), ``output`` (the call's chunks: parsers, trimming the stop
token with its log-prob, finish reason, log-probs, usage, training fields), ``stream`` (engine
token deltas → final text → chunks). This module holds the backend itself: the engine, its
tokenizer, template, parsers and limiter, and the three ways to answer (``answer``, ``chat``,
``chat_stream``), which all come from the same chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.local.control import LocalControl
from gymserve.backends.local.lora import LocalLora
from gymserve.backends.local.output import CallOutput
from gymserve.backends.local.request import LocalCall, echo_pinned_sampling, prepare_call
from gymserve.backends.local.stream import stream_chunks
from gymserve.backends.pool import Limiter
from gymserve.backends.responses_over_chat import ChatAnswer
from gymserve.engine.base import Engine
from gymserve.protocol import ChatCompletionDict, ChatRequest
from gymserve.wire.ids import new_id


class LocalBackend(LocalLora, LocalControl, Backend):
    """Serves one in-process ``Engine``; see the module docstring.

    ``config`` is a ``gymserve.config.LocalBackendConfig``; ``engine`` and ``tokenizer`` are loaded
    by ``LocalBackend.from_config`` (or injected by tests).
    """

    name = "local"
    limiter: Limiter

    def __init__(self, config, engine: Engine, tokenizer, *, max_queue: int = 1024):
        from gymserve.parsers import get_reasoning_parser, tool_call_parser_for
        from gymserve.prompting import ChatTemplate

        # Back-pressure: max_batch_size calls in the engine, max_queue waiting, 429 beyond.
        self.limiter = Limiter(config.max_batch_size, max_queue, name="local backend")

        self.config = config
        self.engine = engine
        # What clients see (``--served-model-name``); the engine's own name still drives parser inference.
        self.model_name = getattr(config, "served_model_name", None) or engine.model_name
        self.tokenizer = tokenizer
        chat_template = None
        if config.chat_template:
            with open(config.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        self.template = ChatTemplate(
            tokenizer, chat_template=chat_template, default_kwargs=dict(config.chat_template_kwargs or {})
        )
        self.tool_parser, self.tool_parser_reason = tool_call_parser_for(
            config.tool_parser or "auto",
            model_type=engine.model_type,
            model_name=engine.model_name,
            chat_template=chat_template or getattr(tokenizer, "chat_template", None),
        )
        self.reasoning_parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        self.stop_token_ids = tuple(dict.fromkeys([*engine.eos_token_ids, *(config.sampling.stop_token_ids or [])]))

    @classmethod
    def from_config(cls, config, *, max_queue: int = 1024) -> LocalBackend:
        """Resolve the model (embedded by default), load tokenizer and engine; ``max_queue``
        bounds the requests waiting for the engine (``OverloadedError``, 429, beyond)."""
        from transformers import AutoTokenizer

        from gymserve.engine import create_engine, resolve_engine_model

        resolved = resolve_engine_model(config)
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
        engine = create_engine(config, resolved)
        return cls(config, engine, tokenizer, max_queue=max_queue)

    def describe(self) -> dict[str, Any]:
        """What ``/health`` and the start-up banner say about this backend."""
        return {
            "backend": "local",
            "target": f"local model {self.config.model}",
            "model": self.model_name,
            "tool_call_parser": getattr(self.tool_parser, "name", None),
            "tool_call_parser_reason": self.tool_parser_reason,
            "reasoning_parser": getattr(self.reasoning_parser, "name", None),
            "context_window": self.engine.context_window,
            "eos_token_ids": list(self.engine.eos_token_ids),
        }

    def fill_responses_defaults(self, request):
        """Echo the pinned sampling params in the Response (the Responses API echoes what ran)."""
        return echo_pinned_sampling(request, self.config.sampling)

    async def models(self) -> list[str]:
        return [self.served_model_name()]

    async def close(self) -> None:
        await self.engine.close()

    # ---- chat ---------------------------------------------------------------------------------

    def _prepare(self, request: ChatRequest) -> tuple[LocalCall, CallOutput]:
        """The engine call for ``request`` (``request.prepare_call``: 400s for what is refused) and
        the object that turns its tokens into chunks."""
        self.check_model(request.get("model"))
        call = prepare_call(
            request,
            template=self.template,
            engine=self.engine,
            sampling_config=self.config.sampling,
            stop_token_ids=self.stop_token_ids,
        )
        return call, CallOutput(
            call,
            tokenizer=self.tokenizer,
            model=self.served_model_name(),
            chunk_id=new_id("chatcmpl"),
            tool_parser=self.tool_parser,
            reasoning_parser=self.reasoning_parser,
            reasoning_field=self.config.reasoning_field,
            stop_token_ids=self.stop_token_ids,
            engine=self.engine,
        )

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The chunks of one finished generation, as ``chat_stream`` would have sent them (usage
        included): what the non-streamed chat answer is folded from and the Response is built from,
        so both equal the streamed ones for the same tokens. Raises ``InvalidRequestError`` (400)
        for what ``prepare_call`` refuses, ``ContextLengthExceededError`` when the prompt fills the
        window."""
        call, output = self._prepare(request)
        async with self.limiter.slot():
            gen = await self.engine.generate(call.prompt.token_ids, call.sampling)
        return ChatAnswer.of_chunks(output.whole(gen), reasoning_field=self.config.reasoning_field)

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """Answer one Chat Completions request: ``answer``'s chunks folded into one completion."""
        return (await self.answer(request, ctx)).as_completion()

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Chunks of one streamed call (``stream.stream_chunks``); the call holds an engine slot
        until the stream ends."""
        _, output = self._prepare(request)
        async with self.limiter.slot():
            stream = stream_chunks(self.engine, output)
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                await stream.aclose()
