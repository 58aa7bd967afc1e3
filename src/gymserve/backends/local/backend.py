"""``LocalBackend``: one in-process engine, token-exact (chat template → prompt token IDs → engine
→ parsers → chunks).

Everything that makes a model call usable for on-policy training happens in this package,
engine-independent, one role per module: ``request`` (the request as one engine call: the on-policy
prefix splice via ``gymserve.prompting``, sampling params pinned to the server config, the
context-window clamp, what is refused), ``output`` (the call's chunks: parsers, the text without
the sampled stop token, finish reason, log-probs, usage, training fields with that token), ``stream`` (engine
token deltas → final text → chunks), ``choices`` (the ``n`` engine calls of one request),
``completions`` and ``completion_output`` (``/v1/completions``), ``tokens`` (``/tokenize``,
``/detokenize``). This module holds the backend itself: the engine, its tokenizer, template,
parsers and limiter, and the three ways to answer a chat request (``answer``, ``chat``,
``chat_stream``), which all come from the same chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.local.choices import interleave, run_all
from gymserve.backends.local.completion_output import vllm_prompt_logprobs
from gymserve.backends.local.completions import LocalCompletions
from gymserve.backends.local.control import LocalControl
from gymserve.backends.local.output import CallOutput
from gymserve.backends.local.request import LocalCall, echo_sampling, prepare_call
from gymserve.backends.local.stream import generate, stream_chunks
from gymserve.backends.local.tokens import LocalTokens
from gymserve.backends.local.tokens_in import LocalTokensIn
from gymserve.backends.local.vllm_fields import answer_id
from gymserve.backends.pool import Limiter
from gymserve.backends.responses_over_chat import ChatAnswer
from gymserve.convert import ChunkAccumulator
from gymserve.engine.base import Engine
from gymserve.engine.ending import Ending
from gymserve.errors import (
    ConflictError,
    ContextLengthExceededError,
    EngineDownError,
    InvalidRequestError,
    NotFoundError,
)
from gymserve.protocol import ChatCompletionDict, ChatRequest, MessagesRequest


class LocalBackend(LocalCompletions, LocalTokens, LocalTokensIn, Backend):
    """Serves one in-process ``Engine``; see the module docstring.

    ``config`` is a ``gymserve.config.LocalBackendConfig``; ``engine`` and ``tokenizer`` are loaded
    by ``LocalBackend.from_config`` (or injected by tests). ``control`` (``local.control``) holds
    the engine's control verbs; the model name a request may use is this class's
    (``served_model_name``, ``check_model``).
    """

    name = "local"
    limiter: Limiter
    control: LocalControl

    def __init__(self, config, engine: Engine, tokenizer, *, max_queue: int = 1024):
        from gymserve.parsers import get_reasoning_parser, tool_call_parser_for
        from gymserve.prompting import ChatTemplate
        from gymserve.prompting.harmony_template import BUILTIN_TEMPLATES

        # Back-pressure: max_num_seqs calls in the engine, max_queue waiting, 429 beyond.
        self.limiter = Limiter(config.max_num_seqs, max_queue, name="local backend")

        self.config = config
        self.engine = engine
        self.control = LocalControl(engine)
        # What clients see (``--served-model-name``); the engine's own name still drives parser inference.
        self.model_name = getattr(config, "served_model_name", None) or engine.model_name
        self.tokenizer = tokenizer
        chat_template = None
        if config.chat_template:
            chat_template = BUILTIN_TEMPLATES.get(config.chat_template)
            if chat_template is None:
                with open(config.chat_template, encoding="utf-8") as f:
                    chat_template = f.read()
        self.tool_parser, self.tool_parser_reason = tool_call_parser_for(
            config.tool_call_parser or "auto",
            model_type=engine.model_type,
            model_name=engine.model_name,
            chat_template=chat_template or getattr(tokenizer, "chat_template", None),
        )
        self.reasoning_parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        turn_ends = {getattr(p, "history_turn_end", None) for p in (self.tool_parser, self.reasoning_parser)}
        self.template = ChatTemplate(
            tokenizer,
            chat_template=chat_template,
            default_kwargs=dict(config.chat_template_kwargs or {}),
            split_special_tokens=getattr(config, "split_special_tokens", True),
            turn_end_tokens=sorted(t for t in turn_ends if t),
        )
        self.stop_token_ids = tuple(dict.fromkeys([*engine.eos_token_ids, *(config.sampling.stop_token_ids or [])]))

    @classmethod
    def from_config(cls, config, *, max_queue: int = 1024) -> LocalBackend:
        """Resolve the model (embedded by default), load tokenizer and engine; ``max_queue``
        bounds the requests waiting for the engine (``OverloadedError``, 429, beyond)."""
        from gymserve.engine import create_engine, load_engine_tokenizer, resolve_engine_model

        resolved = resolve_engine_model(config)
        tokenizer = load_engine_tokenizer(config, resolved)
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

    def check_engine(self) -> None:
        """``EngineDownError`` (503) once the engine's worker died, before a call starts (a stream
        would otherwise answer 200 and then an error event)."""
        fault = getattr(self.engine, "fault", None)
        if fault:
            raise EngineDownError(getattr(self.engine, "engine_name", type(self.engine).__name__), fault)

    async def health(self) -> dict[str, Any]:
        """``ok``, or ``down`` with ``engine`` and ``reason`` once the engine stopped (``engine.fault``:
        a worker-thread engine's dead worker, vLLM's dead engine core); ``/health`` answers 503 then."""
        fault = getattr(self.engine, "fault", None)
        if fault:
            name = getattr(self.engine, "engine_name", type(self.engine).__name__)
            return {
                **self.describe(),
                "status": "down",
                "engine": name,
                "reason": f"the {name} engine stopped on {fault}; restart gymserve (traceback in its log)",
            }
        return await super().health()

    def fill_responses_defaults(self, request):
        """Echo the sampling params the engine runs with in the Response (the Responses API echoes what ran)."""
        return echo_sampling(request, self.config.sampling)

    async def models(self) -> list[str]:
        return [self.served_model_name()]

    # ---- the model's identity: which name serves which weights ---------------------------------
    #
    # vLLM's ``--lora-modules`` convention, where a request's ``model`` picks the adapter: with no
    # adapter loaded the base model serves every request, whatever its ``model``; an adapter loaded
    # under the served name replaces the policy under that name (a trainer pushing its LoRA each
    # step); an adapter loaded under its own name must be named, and the base weights are not
    # available while it is merged (409 for the base name, 404 ``model_not_found`` for any other).

    def served_model_name(self) -> str:
        """The name answers carry: the adapter's when one is loaded under its own name, else the
        model's (``served_model_name`` in the config, else the engine's)."""
        loaded = self.control.lora_adapters()
        return loaded[0]["name"] if loaded else self.model_name

    def check_model(self, requested: Any) -> None:
        """Refuse a request whose ``model`` cannot be served now (see above): ``ConflictError``
        (409, code ``base_model_unavailable``) for the base model while an adapter of another name
        is merged, ``NotFoundError`` (404, code ``model_not_found``) for any other name then."""
        served, base = self.served_model_name(), self.model_name
        if served == base or requested == served:
            return
        if requested == base:
            raise ConflictError(
                f"model {base!r} (the base weights) is not served now: LoRA adapter {served!r} is merged "
                f"into them. Request model {served!r}, or unload the adapter "
                "(POST /v1/unload_lora_adapter) to serve the base model again",
                param="model",
                code="base_model_unavailable",
            )
        raise NotFoundError(
            f"The model {requested!r} does not exist: this server serves {served!r} (a LoRA adapter on {base!r})",
            param="model",
            code="model_not_found",
        )

    async def close(self) -> None:
        await self.engine.close()

    # ---- chat ---------------------------------------------------------------------------------

    def _prepare(self, request: ChatRequest) -> tuple[LocalCall, list[CallOutput]]:
        """The engine call for ``request`` (``request.prepare_call``: 400s for what is refused) and,
        per choice, the object that turns its tokens into chunks."""
        self.check_engine()
        self.check_model(request.get("model"))
        if self.tool_parser is not None and isinstance(request.get("messages"), list):
            # The history's tool-call ids in the form the format's template accepts (Mistral).
            request = {**request, "messages": self.tool_parser.history(request["messages"])}
        effort, kwargs = request.get("reasoning_effort"), request.get("chat_template_kwargs")
        if (
            isinstance(effort, str)
            and (kwargs is None or isinstance(kwargs, dict))
            and "reasoning_effort" not in (kwargs or {})
        ):
            # As vllm serve does: templates that take an effort (harmony's "Reasoning: high") read it.
            request = {**request, "chat_template_kwargs": {**(kwargs or {}), "reasoning_effort": effort}}
        call = prepare_call(
            request,
            template=self.template,
            engine=self.engine,
            sampling_config=self.config.sampling,
            stop_token_ids=self.stop_token_ids,
            tokenizer=self.tokenizer,
        )
        chunk_id = answer_id(request, "chatcmpl")
        return call, [
            CallOutput(
                call,
                tokenizer=self.tokenizer,
                model=self.served_model_name(),
                chunk_id=chunk_id,
                tool_parser=self.tool_parser,
                reasoning_parser=self.reasoning_parser,
                reasoning_field=self.config.reasoning_field,
                stop_token_ids=Ending.of(self.engine.eos_token_ids, call.sampling).stop_ids,
                engine=self.engine,
                index=i,
            )
            for i in range(call.n)
        ]

    async def _whole(self, call: LocalCall, output: CallOutput) -> list[dict[str, Any]]:
        """One choice generated to the end (an engine slot while it runs), as its chunks."""
        async with self.limiter.slot():
            gen = await generate(self.engine, call.prompt.token_ids, call.sampling_for(output.index), self.tokenizer)
        return output.whole(gen)

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The chunks of one finished generation, as ``chat_stream`` would have sent them (usage
        included): what the Response is built from, so it equals the streamed one for the same
        tokens. Raises ``InvalidRequestError`` (400) for what ``prepare_call`` refuses (and for
        ``n > 1``: the Responses API has one output per response), ``ContextLengthExceededError``
        when the prompt fills the window."""
        call, outputs = self._prepare(request)
        if call.n != 1:
            raise InvalidRequestError("n > 1 asks for several answers; this path makes one", param="n")
        return ChatAnswer.of_chunks(await self._whole(call, outputs[0]), reasoning_field=self.config.reasoning_field)

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """Answer one Chat Completions request: each choice's chunks folded into its message (the
        same chunks ``chat_stream`` sends), the training fields on each choice's message, usage
        counting the prompt once and every sampled token of every choice."""
        call, outputs = self._prepare(request)
        answers = await run_all([self._whole(call, output) for output in outputs])
        completions = []
        for output, chunks in zip(outputs, answers):
            accumulator = ChunkAccumulator(output.index)
            for chunk in chunks:
                accumulator.add(chunk)
            completions.append(accumulator.completion(reasoning_field=self.config.reasoning_field))
        completion = completions[0]
        completion["choices"] = [c["choices"][0] for c in completions]
        completion["usage"] = _usage(call, outputs)
        for output, choice in zip(outputs, completion["choices"]):
            choice["stop_reason"] = output.stop_reason  # vLLM's: the stop string or stop token ID
        if call.sampling.prompt_logprobs is not None and outputs[0].prompt_logprobs is not None:
            completion["prompt_logprobs"] = vllm_prompt_logprobs(
                call.prompt.token_ids, outputs[0].prompt_logprobs, self.tokenizer
            )
        if call.return_token_ids:  # vLLM's places: the prompt once, each choice's generation
            completion["prompt_token_ids"] = call.prompt.token_ids
            for choice in completion["choices"]:
                choice["token_ids"] = choice["message"]["generation_token_ids"]
        return completion

    async def count_tokens(self, request: MessagesRequest, ctx: RequestContext) -> int:
        """The prompt length of a Messages request as the engine would see it (chat template, tools,
        the prefix splice), even when it fills the context window; no engine slot is taken."""
        from gymserve.convert.field_paths import MESSAGES, FieldPaths
        from gymserve.convert.messages_to_chat import messages_to_chat

        paths = FieldPaths(MESSAGES)
        chat = messages_to_chat(request, self.convert_options(), paths, count_only=True)
        try:
            call, _ = self._prepare({**chat, "max_tokens": 1})
        except ContextLengthExceededError as exc:
            if exc.prompt_tokens is None:
                raise
            return exc.prompt_tokens
        except InvalidRequestError as exc:  # named with the chat request's fields (messages_over_chat)
            raise paths.translate(exc) from None
        return len(call.prompt.token_ids)

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Chunks of one streamed call (``stream.stream_chunks``); each choice holds an engine slot
        until its stream ends. ``n > 1``: the choices' chunks interleaved as they are sampled, each
        with its ``index``, and one usage chunk at the end (``stream_options.include_usage``)."""
        call, outputs = self._prepare(request)
        streams = [
            self._stream_choice(call, output, include_usage=call.include_usage and call.n == 1) for output in outputs
        ]
        merged = interleave(streams)
        try:
            async for chunk in merged:
                yield chunk
        finally:
            await merged.aclose()
        if call.include_usage and call.n > 1:
            head = outputs[0].role()
            yield {
                **{k: head[k] for k in ("id", "object", "created", "model")},
                "choices": [],
                "usage": _usage(call, outputs),
            }

    async def _stream_choice(self, call: LocalCall, output: CallOutput, *, include_usage: bool):
        async with self.limiter.slot():
            stream = stream_chunks(
                self.engine,
                output,
                call.prompt.token_ids,
                call.sampling_for(output.index),
                include_usage=include_usage,
            )
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                await stream.aclose()


def _usage(call: LocalCall, outputs: list[CallOutput]) -> dict[str, int]:
    """Usage of a call: the prompt once, every token sampled for every choice (stop tokens included)."""
    prompt, completion = len(call.prompt.token_ids), sum(o.sampled for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
