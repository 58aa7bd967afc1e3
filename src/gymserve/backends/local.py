"""The token-exact local backend: chat template → prompt token IDs → engine → parsers → ChatCompletion.

Everything that makes a model call usable for on-policy training happens here, engine-independent:
the on-policy prefix splice (``gymserve.prompting``), sampling params pinned to the server config, the
context-window clamp, trimming the stop token from the generation together with its log-prob, and
the tool-call / reasoning parsers over the generated text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.local_control import LocalControl, version_fields
from gymserve.backends.local_lora import LocalLora
from gymserve.backends.local_request import LocalCall, prepare_call
from gymserve.engine.base import Engine, Generation
from gymserve.protocol import ChatCompletionDict, ChatRequest


@dataclass
class _Parsed:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


class LocalBackend(LocalLora, LocalControl, Backend):
    """Serves one in-process ``Engine``; see the module docstring.

    ``config`` is a ``gymserve.config.LocalBackendConfig``; ``engine`` and ``tokenizer`` are loaded
    by ``LocalBackend.from_config`` (or injected by tests).
    """

    name = "local"

    def __init__(self, config, engine: Engine, tokenizer, *, max_queue: int = 1024):
        from gymserve.backends.pool import Limiter
        from gymserve.parsers import get_reasoning_parser, get_tool_call_parser, infer_tool_call_parser
        from gymserve.prompting import ChatTemplate

        # Back-pressure: max_batch_size calls in the engine, max_queue waiting, 429 beyond.
        self.limiter = Limiter(config.max_batch_size, max_queue, name="local backend")

        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        chat_template = None
        if config.chat_template:
            with open(config.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        self.template = ChatTemplate(tokenizer, chat_template=chat_template,
                                     default_kwargs=dict(config.chat_template_kwargs or {}))
        parser_name = config.tool_parser
        self.tool_parser_reason = "configured"
        if parser_name in (None, "", "auto"):
            parser_name, self.tool_parser_reason = infer_tool_call_parser(
                engine.model_type, engine.model_name, chat_template or getattr(tokenizer, "chat_template", None))
        self.tool_parser = get_tool_call_parser(parser_name) if parser_name != "none" else None
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
            "backend": "local", "model": self.engine.model_name,
            "tool_call_parser": getattr(self.tool_parser, "name", None),
            "tool_call_parser_reason": self.tool_parser_reason,
            "reasoning_parser": getattr(self.reasoning_parser, "name", None),
            "context_window": self.engine.context_window, "eos_token_ids": list(self.engine.eos_token_ids),
        }

    def fill_responses_defaults(self, request):
        """Echo the pinned sampling params in the Response (the Responses API echoes what ran)."""
        sampling = self.config.sampling
        pinned = {"temperature": sampling.temperature, "top_p": sampling.top_p}
        forced = sampling.on_mismatch == "override"
        fill = {k: v for k, v in pinned.items() if v is not None and (forced or request.get(k) is None)}
        return {**request, **fill} if fill else request

    async def models(self) -> list[str]:
        return [self.served_model_name()]

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", **self.describe()}

    async def close(self) -> None:
        await self.engine.close()

    # ---- chat ---------------------------------------------------------------------------------

    def _prepare(self, request: ChatRequest) -> LocalCall:
        self.check_model(request.get("model"))
        return prepare_call(request, template=self.template, engine=self.engine,
                            sampling_config=self.config.sampling, stop_token_ids=self.stop_token_ids)

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """Answer one Chat Completions request; see ``prepare_call`` for what is rejected (400)."""
        call = self._prepare(request)
        async with self.limiter.slot():
            gen = await self.engine.generate(call.prompt.token_ids, call.sampling)
        return self._completion(call, gen)

    def _trim(self, gen: Generation) -> tuple[list[int], list[float], list]:
        """Drop the final stop/EOS token and its log-prob: the template closes the turn itself,
        and the prefix splice re-adds it (see ``prompting.splice``)."""
        ids, lps, tops = gen.token_ids, gen.log_probs, gen.top_logprobs
        if gen.finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids:
            return ids[:-1], lps[:-1], tops[:-1]
        return ids, lps, tops

    def _parse(self, call: LocalCall, text: str, finish_reason: str) -> _Parsed:
        from gymserve.parsers import parse_output

        tool_parser = self.tool_parser if call.parse_tools else None
        out = parse_output(text, prompt_tail=call.prompt.text_tail, finish_reason=finish_reason,
                           tools=call.tools, tool_parser=tool_parser, reasoning_parser=self.reasoning_parser)
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in out.tool_calls]
        return _Parsed(out.reasoning, out.content, calls,
                       chat_finish_reason(finish_reason, out.reasoning_incomplete, bool(calls)))

    def _completion(self, call: LocalCall, gen: Generation) -> ChatCompletionDict:
        ids, lps, tops = self._trim(gen)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        parsed = self._parse(call, text, gen.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message[self.config.reasoning_field] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        message["prompt_token_ids"] = call.prompt.token_ids
        message["generation_token_ids"] = ids
        message["generation_log_probs"] = lps
        message.update(version_fields(gen, len(ids), self.engine))
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": parsed.finish_reason,
                                  "logprobs": self._logprobs(call, ids, lps, tops) if call.logprobs else None}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.served_model_name(), "choices": [choice],
            "usage": usage(len(call.prompt.token_ids), len(gen.token_ids)),
        }

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

    async def responses(self, request, ctx: RequestContext):
        """The Response built by the streaming builder from the chunks of the finished generation
        (``local_stream.generation_chunks``), so it is the streamed Response for the same tokens:
        items in the order the model wrote them, the same ids' places, the same final values. A
        prompt that fills the context window gives the empty incomplete Response (case CL-01)."""
        from gymserve.backends.local_stream import generation_chunks
        from gymserve.convert import context_exceeded_response, responses_to_chat
        from gymserve.convert.stream import ResponseStreamBuilder
        from gymserve.errors import ContextLengthExceededError

        request = self.fill_responses_defaults(request)
        chat_request = {**responses_to_chat(request, self.convert_options()), "stream": True,
                        "stream_options": {"include_usage": True}}
        try:
            call = self._prepare(chat_request)
        except ContextLengthExceededError:
            return context_exceeded_response(request)
        async with self.limiter.slot():
            gen = await self.engine.generate(call.prompt.token_ids, call.sampling)
        builder = ResponseStreamBuilder(request)
        for chunk in generation_chunks(self, call, gen):
            builder.feed(chunk)
        builder.finish()
        assert builder.response is not None
        return builder.response

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
