"""The engine interface: prompt token IDs and sampling params in; tokens, log-probs, finish reason out.

Everything above the engine (templating, prefix splice, parsers, pinned sampling, context clamp,
stop-token trimming) is engine-independent; an engine only turns token IDs into token IDs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters, as vLLM's ``SamplingParams`` spells them.

    ``temperature`` 0 means greedy. ``top_k`` ``None`` or ``<= 0`` means no top-k filter.
    ``max_tokens`` is the number of new tokens, already clamped to the context window.
    ``stop_token_ids`` end generation when sampled (in addition to the model's EOS IDs); the
    stopping token is part of the engine's output and is trimmed by the caller.
    ``top_logprobs`` asks for that many alternatives per position (0: none).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0


@dataclass
class Generation:
    """One finished generation.

    ``token_ids``: sampled IDs, including a final EOS/stop token when ``finish_reason == "stop"``.
    ``log_probs``: natural-log probability of each sampled token under the sampling distribution's
    logits before temperature/top-p/top-k (the policy's log-probs), same length as ``token_ids``.
    ``top_logprobs``: per position, ``[(token_id, logprob), ...]`` when asked for, else empty.
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class TokenDelta:
    """A streamed step: newly sampled IDs and their log-probs; ``finish_reason`` set on the last one."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


async def collect(stream: AsyncIterator[TokenDelta]) -> Generation:
    """A whole ``Generation`` from an engine's token deltas (how engines implement ``generate``)."""
    gen = Generation(token_ids=[], log_probs=[], finish_reason="length")
    async for delta in stream:
        gen.token_ids += delta.token_ids
        gen.log_probs += delta.log_probs
        gen.top_logprobs += delta.top_logprobs
        if delta.finish_reason:
            gen.finish_reason = delta.finish_reason
    return gen


class RunBasedEngine:
    """Shared plumbing for engines with one code path ``_run(prompt_ids, sampling, stream=...)``
    yielding ``TokenDelta``s (the vLLM and TensorRT-LLM adapters)."""

    _closed = False

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Generate to completion; see ``Engine.generate``."""
        return await collect(self._run(prompt_ids, sampling, stream=False))

    def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Yield token deltas; closing the iterator early aborts the request."""
        return self._run(prompt_ids, sampling, stream=True)

    def _check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raises ``EngineError`` when the engine is shut down or the prompt is empty."""
        from gymserve.errors import EngineError

        if self._closed:
            raise EngineError("the engine is shut down")
        if not prompt_ids:
            raise EngineError("empty prompt")

    def _run(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, stream: bool) -> AsyncIterator[TokenDelta]:
        raise NotImplementedError


@runtime_checkable
class Engine(Protocol):
    """What the local backend needs from an inference engine.

    ``model_type``: the Hugging Face config's ``model_type`` (``config.json``, e.g. ``"qwen2"``), or
    ``None`` when the model directory does not say; tool-call parser inference reads it.
    ``eos_token_ids``: every ID that ends a turn (generation_config may list several).
    ``context_window``: max prompt + generation tokens. ``vocab_size``: valid IDs are ``[0, vocab_size)``.
    Implementations must keep the event loop free (generate off-thread or in another process) and
    may batch concurrent requests.
    """

    model_name: str
    model_type: str | None
    eos_token_ids: tuple[int, ...]
    context_window: int
    vocab_size: int

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation: ...

    def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Yield token deltas as they are sampled; closing the iterator cancels the generation."""
        ...

    async def close(self) -> None: ...
