"""The token-exact local backend: chat template → prompt token IDs → engine → parsers → ChatCompletion.

Everything that makes a model call usable for on-policy training happens here, engine-independent:
the on-policy prefix splice (``gymserve.prompting``), sampling params pinned to the server config, the
context-window clamp, trimming the stop token from the generation together with its log-prob, and
the tool-call / reasoning parsers over the generated text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.local_control import LocalControl
from gymserve.backends.local_request import LocalCall, echo_pinned_sampling, prepare_call
from gymserve.engine.base import Engine, Generation
from gymserve.protocol import ChatCompletionDict, ChatRequest

if TYPE_CHECKING:
    from gymserve.backends.responses_over_chat import ChatAnswer


class LocalBackend(LocalControl, Backend):
    """Serves one in-process ``Engine``; see the module docstring.

    ``config`` is a ``gymserve.config.LocalBackendConfig``; ``engine`` and ``tokenizer`` are loaded
    by ``LocalBackend.from_config`` (or injected by tests).
    """

    name = "local"

    def __init__(self, config, engine: Engine, tokenizer, *, max_queue: int = 1024):
        from gymserve.backends.pool import Limiter
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
        self.template = ChatTemplate(tokenizer, chat_template=chat_template,
                                     default_kwargs=dict(config.chat_template_kwargs or {}))
        self.tool_parser, self.tool_parser_reason = tool_call_parser_for(
            config.tool_parser or "auto", model_type=engine.model_type, model_name=engine.model_name,
            chat_template=chat_template or getattr(tokenizer, "chat_template", None))
        self.reasoning_parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        self.stop_token_ids = tuple(dict.fromkeys(
            [*engine.eos_token_ids, *(config.sampling.stop_token_ids or [])]))

    @classmethod
    def from_config(cls, config, *, max_queue: int = 1024) -> LocalBackend:
        """Resolve the model (embedded by default), load tokenizer and engine; ``max_queue``
        bounds the requests waiting for the engine (``OverloadedError``, 429, beyond)."""
        from transformers import AutoTokenizer

        from gymserve.engine import create_engine
        from gymserve.engine.model_store import resolve_model

        resolved = resolve_model(config.model)
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
        engine = create_engine(config, resolved)
        return cls(config, engine, tokenizer, max_queue=max_queue)

    def describe(self) -> dict[str, Any]:
        """What ``/health`` and the start-up banner say about this backend."""
        return {
            "backend": "local", "target": f"local model {self.config.model}", "model": self.model_name,
            "tool_call_parser": getattr(self.tool_parser, "name", None),
            "tool_call_parser_reason": self.tool_parser_reason,
            "reasoning_parser": getattr(self.reasoning_parser, "name", None),
            "context_window": self.engine.context_window, "eos_token_ids": list(self.engine.eos_token_ids),
        }

    def fill_responses_defaults(self, request):
        """Echo the pinned sampling params in the Response (the Responses API echoes what ran)."""
        return echo_pinned_sampling(request, self.config.sampling)

    async def models(self) -> list[str]:
        return [self.model_name]

    async def close(self) -> None:
        await self.engine.close()

    # ---- chat ---------------------------------------------------------------------------------

    def _prepare(self, request: ChatRequest) -> LocalCall:
        return prepare_call(request, template=self.template, engine=self.engine,
                            sampling_config=self.config.sampling, stop_token_ids=self.stop_token_ids)

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The chunks of one finished generation, as ``chat_stream`` would have sent them (usage
        included): what the non-streamed chat answer is folded from and the Response is built from,
        so both equal the streamed ones for the same tokens. See ``prepare_call`` for what is
        rejected (400, ``ContextLengthExceededError`` when the prompt fills the window)."""
        from gymserve.backends.local_stream import generation_chunks
        from gymserve.backends.responses_over_chat import ChatAnswer

        call = self._prepare(request)
        async with self.limiter.slot():
            gen = await self.engine.generate(call.prompt.token_ids, call.sampling)
        return ChatAnswer.of_chunks(generation_chunks(self, call, gen), reasoning_field=self.config.reasoning_field)

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """Answer one Chat Completions request: ``answer``'s chunks folded into one completion."""
        return (await self.answer(request, ctx)).as_completion()

    def _trim(self, gen: Generation) -> tuple[list[int], list[float], list]:
        """Drop the final stop/EOS token and its log-prob: the template closes the turn itself,
        and the prefix splice re-adds it (see ``prompting.splice``)."""
        ids, lps, tops = gen.token_ids, gen.log_probs, gen.top_logprobs
        if gen.finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids:
            return ids[:-1], lps[:-1], tops[:-1]
        return ids, lps, tops

    def _token_str(self, call: LocalCall, tid: int) -> str:
        if call.tokens_as_ids:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _logprobs(self, call: LocalCall, ids, lps, tops) -> dict[str, Any]:
        """Standard ``choices[].logprobs`` (vLLM's ``return_tokens_as_token_ids`` spelling honoured)."""
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps)):
            s = self._token_str(call, tid)
            alts = [{"token": self._token_str(call, a), "logprob": alp,
                     "bytes": list(self._token_str(call, a).encode())} for a, alp in (tops[i] if i < len(tops) else [])]
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
        return {"content": content, "refusal": None}

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Chunks of one streamed call; the call holds an engine slot until the stream ends."""
        from gymserve.backends.local_stream import stream_chat

        call = self._prepare(request)
        async with self.limiter.slot():
            stream = stream_chat(self, call)
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                await stream.aclose()


def chat_finish_reason(engine_finish: str, reasoning_incomplete: bool, has_tool_calls: bool) -> str:
    """The chat ``finish_reason``: ``abort`` for a call ended by ``POST /pause?mode=abort`` (vLLM's
    value), ``length`` when generation stopped at the limit or inside the reasoning span, else
    ``tool_calls`` when calls were parsed, else ``stop``."""
    if engine_finish == "abort":
        return "abort"
    if engine_finish == "length" or reasoning_incomplete:
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """Chat ``usage``; ``completion_tokens`` counts every sampled token, the trimmed EOS included."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
