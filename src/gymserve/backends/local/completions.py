"""``POST /v1/completions`` on the local engine: prompts (text or token IDs) in, ``n`` choices each.

A base model's prompt is given as it is: text is tokenized with the tokenizer's own special tokens
(``add_special_tokens``, default true, as vLLM does for completions; special tokens written in the
text are recognised, as there), token IDs go to the engine unchanged, so a rollout that builds its
own prompts from earlier prompt + generation IDs stays token-contiguous by construction. The rules
of the chat route hold here too (``request``): the sampling params (the request's, or pinned), ``max_tokens``
clamped to the context window (default 16, the API's), vLLM's ending fields (``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``stop`` strings: ``engine.ending``) applied, penalties,
``logit_bias`` and the extras of ``vllm_fields.REFUSED`` refused, choice ``j`` of a prompt sampled
with ``seed + j``.

``echo`` returns the prompt's text before the generation; with ``logprobs: k`` it also scores the
prompt: the engine computes every prompt token's log-prob in the prefill (``SamplingParams.
prompt_logprobs``, one teacher-forced forward pass on the weights that sample the first token), and
``choices[i].logprobs`` lists the prompt's tokens first, the first one's log-prob ``null``, then the
generated ones. vLLM's ``prompt_logprobs: k`` field asks for the same scores without ``echo`` and
returns them as ``choices[i].prompt_logprobs`` (also there with echo + logprobs, as in vLLM: its
``CompletionRequest.to_sampling_params`` sets ``prompt_logprobs = logprobs`` when echo is on, and
``serving_completion.py`` joins ``[*prompt_logprobs, *output.logprobs]`` for echoed choices). An
engine without the capability answers 501 (``engine.base.check_prompt_logprobs``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymserve.backends.context import RequestContext
from gymserve.backends.local import structured
from gymserve.backends.local.choices import interleave, run_all
from gymserve.backends.local.completion_output import CompletionOutput
from gymserve.backends.local.request import (
    check_min_tokens,
    check_supported,
    choice_count,
    ending_params,
    engine_sampling,
)
from gymserve.backends.local.stream import generate, stream_chunks
from gymserve.backends.local.vllm_fields import answer_id, check_extras
from gymserve.convert.completions_request import DEFAULT_MAX_TOKENS, prompts
from gymserve.engine.base import SamplingParams, check_prompt_logprobs
from gymserve.engine.ending import Ending
from gymserve.errors import ContextLengthExceededError, InvalidRequestError
from gymserve.protocol import check_token_ids


@dataclass
class CompletionCall:
    """One ``/v1/completions`` request as engine calls: per prompt its IDs, text and ``max_tokens``
    (clamped to what its length leaves of the context window); ``n`` choices of each."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    max_tokens: list[int]
    sampling: SamplingParams
    n: int
    logprobs: int | None
    prompt_logprobs: int | None
    echo: bool
    tokens_as_ids: bool
    include_usage: bool
    return_token_ids: bool = False

    def sampling_for(self, prompt: int, choice: int) -> SamplingParams:
        """Sampling of choice ``choice`` of prompt ``prompt``: its ``max_tokens``, ``seed + choice``."""
        seed = self.sampling.seed
        return dataclasses.replace(
            self.sampling,
            max_tokens=self.max_tokens[prompt],
            seed=seed + choice if seed is not None else None,
        )


def prepare_completion(
    request: dict[str, Any], *, tokenizer: Any, engine: Any, sampling_config: Any, stop_token_ids: tuple[int, ...]
) -> CompletionCall:
    """Validate a checked ``/v1/completions`` request against this engine and build its calls.

    Raises ``InvalidRequestError`` (400, naming the field: ``prompt[1][3]`` for an ID outside the
    vocabulary, sampling params out of range or pinned, stop strings...), ``ContextLengthExceededError`` when a prompt
    fills the context window, and ``NotSupportedError`` (501) when prompt log-probs are asked of an
    engine that does not compute them."""
    check_supported(request)
    check_extras(request, chat=False)
    logprobs = request.get("logprobs")
    prompt_logprobs = request.get("prompt_logprobs")
    if prompt_logprobs is None and request.get("echo"):
        prompt_logprobs = logprobs  # vLLM's rule: echo scores the prompt as deeply as the generation
    if prompt_logprobs is not None:
        check_prompt_logprobs(engine)
    listed = prompts(request)
    single = not isinstance(request["prompt"], list) or all(type(t) is int for t in request["prompt"])
    add_special = request.get("add_special_tokens", True)
    ids_list, texts, limits = [], [], []
    for i, prompt in enumerate(listed):
        param = "prompt" if single else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = list(tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
            text = prompt
            if not ids:
                raise InvalidRequestError(f"{param} is empty; give some text or token IDs", param=param)
        else:
            ids = check_token_ids(prompt, param=param, vocab_size=engine.vocab_size)
            text = tokenizer.decode(ids, skip_special_tokens=False)
        room = engine.context_window - len(ids)
        if room <= 0:
            raise ContextLengthExceededError(len(ids), engine.context_window)
        ids_list.append(ids)
        texts.append(text)
        limits.append(min(request.get("max_tokens", DEFAULT_MAX_TOKENS), room))
    options = request.get("stream_options") or {}
    sampling = engine_sampling(
        request,
        sampling_config,
        max_tokens=limits[0],
        top_logprobs=logprobs or 0,
        prompt_logprobs=prompt_logprobs,
        constraint=structured.constraint(request, engine=engine, tokenizer=tokenizer),
        **ending_params(request, stop_token_ids=stop_token_ids, vocab_size=engine.vocab_size),
    )
    for limit in limits:
        check_min_tokens(dataclasses.replace(sampling, max_tokens=limit))
    return CompletionCall(
        prompt_ids=ids_list,
        prompt_texts=texts,
        max_tokens=limits,
        sampling=sampling,
        n=choice_count(request),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        echo=bool(request.get("echo")),
        tokens_as_ids=bool(request.get("return_tokens_as_token_ids")),
        include_usage=bool(options.get("include_usage")),
        return_token_ids=bool(request.get("return_token_ids")),
    )


class LocalCompletions:
    """``/v1/completions`` for ``LocalBackend`` (a mixin: it uses the backend's engine, tokenizer,
    limiter, config and stop IDs). Every choice is one engine call holding one engine slot."""

    engine: Any
    tokenizer: Any
    limiter: Any
    config: Any
    stop_token_ids: tuple[int, ...]

    if TYPE_CHECKING:  # LocalBackend's (its model identity)

        def check_model(self, requested: Any) -> None: ...

        def check_engine(self) -> None: ...
        def served_model_name(self) -> str: ...

    def _completion_outputs(self, request: dict[str, Any]) -> tuple[CompletionCall, list[CompletionOutput]]:
        self.check_engine()
        self.check_model(request.get("model"))
        call = prepare_completion(
            request,
            tokenizer=self.tokenizer,
            engine=self.engine,
            sampling_config=self.config.sampling,
            stop_token_ids=self.stop_token_ids,
        )
        head = {"id": answer_id(request, "cmpl"), "object": "text_completion", "created": int(time.time())}
        head["model"] = self.served_model_name()
        outputs = [
            CompletionOutput(
                prompt_ids=ids,
                prompt_text=text,
                index=i * call.n + j,
                head=head,
                tokenizer=self.tokenizer,
                stop_token_ids=Ending.of(self.engine.eos_token_ids, call.sampling).stop_ids,
                logprobs=call.logprobs,
                prompt_logprobs=call.prompt_logprobs,
                echo=call.echo,
                tokens_as_ids=call.tokens_as_ids,
                return_token_ids=call.return_token_ids,
                engine=self.engine,
                include_stop=call.sampling.include_stop_str_in_output,
            )
            for i, (ids, text) in enumerate(zip(call.prompt_ids, call.prompt_texts))
            for j in range(call.n)
        ]
        return call, outputs

    async def completions(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """The ``Completion`` dict: choices in vLLM's order (prompt ``i``, choice ``j`` at ``i * n + j``),
        usage counting each prompt once and every sampled token. Errors: see ``prepare_completion``."""
        call, outputs = self._completion_outputs(request)

        async def one(output: CompletionOutput) -> dict[str, Any]:
            prompt, choice = divmod(output.index, call.n)
            async with self.limiter.slot():
                gen = await generate(self.engine, output.prompt_ids, call.sampling_for(prompt, choice), self.tokenizer)
            return output.choice(gen)

        choices = await run_all([one(o) for o in outputs])
        return {**outputs[0].head, "choices": choices, "usage": _usage(call, outputs)}

    async def completions_stream(self, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Chunks of every choice as they are sampled (interleaved, each with its ``index``), then
        one usage chunk with ``stream_options.include_usage``."""
        call, outputs = self._completion_outputs(request)

        async def one(output: CompletionOutput):
            prompt, choice = divmod(output.index, call.n)
            async with self.limiter.slot():
                stream = stream_chunks(
                    self.engine, output, output.prompt_ids, call.sampling_for(prompt, choice), include_usage=False
                )
                try:
                    async for chunk in stream:
                        yield chunk
                finally:
                    await stream.aclose()

        merged = interleave([one(o) for o in outputs])
        try:
            async for chunk in merged:
                yield chunk
        finally:
            await merged.aclose()
        if call.include_usage:
            yield {**outputs[0].head, "choices": [], "usage": _usage(call, outputs)}


def _usage(call: CompletionCall, outputs: list[CompletionOutput]) -> dict[str, int]:
    prompt = sum(len(ids) for ids in call.prompt_ids)
    completion = sum(o.sampled for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
