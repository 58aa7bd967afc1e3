"""The engine interface: prompt token IDs and sampling params in; tokens, log-probs, finish reason out.

Everything above the engine (templating, prefix splice, parsers, sampling params, context clamp,
which tokens' text is shown) is engine-independent; an engine only turns token IDs into token IDs.

The engine also owns the control plane of a policy being trained (``Engine.pause_generation``,
``update_weights``, ...; named as vLLM names them, see docs/concepts/training-control.md): each
token it streams says which weight version sampled it (``TokenDelta.weight_version``), and
``collect`` turns those into ``Generation.weight_version_spans``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self, runtime_checkable

# The control plane's vocabulary (weight versions, pause modes) is declared with its verbs; named
# here too because every engine speaks it.
from gymserve.control import PauseMode, WeightVersion

FinishReason = Literal["stop", "length", "abort"]
"""``abort``: ended by ``pause_generation(mode="abort")``, keeping the tokens sampled so far (vLLM's
finish reason for an aborted request)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters, as vLLM's ``SamplingParams`` spells them.

    ``temperature`` 0 means greedy. ``top_k`` ``None`` or ``<= 0`` means no top-k filter. ``min_p``
    (0: off) drops the tokens less likely than ``min_p`` times the most likely one, after
    temperature (vLLM's order: temperature, min-p, top-k, top-p).
    ``max_tokens`` is the number of new tokens, already clamped to the context window.
    ``stop_token_ids`` end generation when sampled (in addition to the model's EOS IDs); the
    stopping token is part of the engine's output, with its log-prob (a training token, as in vLLM).
    ``min_tokens`` (vLLM's): the stop set is masked out until that many tokens were sampled;
    ``ignore_eos`` (vLLM's): the EOS IDs do not end the generation (``stop_token_ids`` still do);
    ``stop``: stop strings, which the local backend applies on the decoded text (engines see token
    IDs only). The rule of all of them: ``engine.ending``.
    ``top_logprobs`` asks for that many alternatives per position (0: none).
    ``prompt_logprobs`` (vLLM's field of the same name): ``None`` computes none; ``k >= 0`` asks for
    every prompt token's log-prob given the tokens before it, its rank and the ``k`` most likely
    alternatives (``PromptLogprobs``), on the weights that sample the first token. Only engines with
    ``supports_prompt_logprobs`` compute them (``check_prompt_logprobs``).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    constraint: Any = None
    """Structured output: a factory (no arguments) of one call's ``TokenConstraint``, or None. Only
    engines with ``supports_structured_output`` apply it (the transformers engine)."""


class TokenConstraint(Protocol):
    """One call's grammar state (structured output): ``mask(logits)`` returns the logits with every
    token the grammar forbids next set to -inf (a copy; the reported log-probs stay the raw
    model's), ``accept(token)`` advances the grammar past the sampled token."""

    def mask(self, logits: Any) -> Any: ...

    def accept(self, token: int) -> None: ...


@dataclass
class PromptLogprobs:
    """The prompt's tokens scored by one teacher-forced forward pass (vLLM's ``prompt_logprobs``).

    Lists of the prompt's length ``P``; position 0 has no context, so its entries are ``None`` /
    ``[]`` (vLLM's first ``prompt_logprobs`` entry is ``None`` likewise). ``log_probs[i]``: the raw
    ``log_softmax`` log-prob of ``prompt_ids[i]`` given ``prompt_ids[:i]`` (the same distribution as
    ``Generation.log_probs``); ``ranks[i]``: 1 + how many tokens are more likely, ties counted
    against it (vLLM's ``Logprob.rank``); ``top_logprobs[i]``: the ``k`` most likely
    ``(token_id, logprob)`` pairs there, most likely first."""

    log_probs: list[float | None]
    ranks: list[int | None]
    top_logprobs: list[list[tuple[int, float]]]


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
    weight_version_spans: list[dict[str, Any]] = field(default_factory=list)
    """``[{"version": v, "start": i, "end": j}, ...]``: token ``token_ids[k]`` for ``i <= k < j`` was
    sampled by weight version ``v``; in order, covering every token; empty when the engine does not
    report versions."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's log-probs when ``SamplingParams.prompt_logprobs`` asked for them, computed on the
    weights that sampled the first token (``weight_version_spans[0]``)."""
    stop_reason: int | str | None = None
    """vLLM's ``stop_reason``: the stop string or stop token ID that ended it (``engine.ending``)."""


@dataclass
class TokenDelta:
    """A streamed step: newly sampled IDs and their log-probs; ``finish_reason`` set on the last one.

    ``weight_version``: the weights that sampled these tokens (None: the engine does not say). A
    final delta may carry no tokens (``finish_reason`` ``"abort"``)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    weight_version: WeightVersion | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """Set on the first delta of a call that asked for them (``SamplingParams.prompt_logprobs``)."""


def check_prompt_logprobs(engine: Any) -> None:
    """Raise ``NotSupportedError`` (501, code ``prompt_logprobs_not_supported``) unless ``engine``
    computes prompt log-probs (its ``supports_prompt_logprobs`` is true; an engine that does not say
    does not). The transformers and vLLM engines do; the TensorRT-LLM
    and llama.cpp adapters do not map it yet."""
    if getattr(engine, "supports_prompt_logprobs", False):
        return
    from gymserve.errors import NotSupportedError

    name = getattr(engine, "engine_name", None) or type(engine).__name__
    raise NotSupportedError(
        f"the {name} engine does not compute prompt log-probs (asked for by echo with logprobs, or by "
        "prompt_logprobs); serve the model with the transformers engine (backend.engine: transformers), or "
        "leave echo and prompt_logprobs out (the generated tokens' log-probs come with logprobs)",
        code="prompt_logprobs_not_supported",
    )


def extend_spans(spans: list[dict[str, Any]], version: WeightVersion | None, start: int, count: int) -> None:
    """Record that ``count`` tokens from index ``start`` on came from ``version`` (in place): the
    last span grows when the version is the same, else a new span starts."""
    if version is None or count <= 0:
        return
    if spans and spans[-1]["version"] == version and spans[-1]["end"] == start:
        spans[-1]["end"] = start + count
    else:
        spans.append({"version": version, "start": start, "end": start + count})


async def collect(stream: AsyncIterator[TokenDelta]) -> Generation:
    """A whole ``Generation`` from an engine's token deltas (how engines implement ``generate``)."""
    gen = Generation(token_ids=[], log_probs=[], finish_reason="length")
    async for delta in stream:
        extend_spans(gen.weight_version_spans, delta.weight_version, len(gen.token_ids), len(delta.token_ids))
        gen.token_ids += delta.token_ids
        gen.log_probs += delta.log_probs
        gen.top_logprobs += delta.top_logprobs
        gen.prompt_logprobs = gen.prompt_logprobs or delta.prompt_logprobs
        if delta.finish_reason:
            gen.finish_reason = delta.finish_reason
    return gen


class NoControl:
    """The control plane of an engine that does not implement it yet: every operation raises
    ``NotSupportedError`` (501) naming the engine; the weights it loaded stay version 0."""

    engine_name = "this"
    weight_version: WeightVersion = 0
    supports_prompt_logprobs = False

    def _unsupported(self, what: str):
        from gymserve.errors import NotSupportedError

        return NotSupportedError(
            f"{what} is not supported yet by the {self.engine_name} engine; use the transformers engine "
            "(backend.engine: transformers), or drive your own server's control API through the chat backend",
            code="control_not_supported",
        )

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        raise self._unsupported("pause_generation")

    async def resume_generation(self) -> None:
        raise self._unsupported("resume_generation")

    async def is_paused(self) -> bool:
        return False

    async def update_weights(
        self, tensors: Any = None, *, path: str | os.PathLike | None = None, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        raise self._unsupported("update_weights")

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        raise self._unsupported("update_weight_version")

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        *,
        tensors: Any = None,
        config: Any = None,
        load_inplace: bool = False,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        raise self._unsupported("load_lora_adapter")

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        raise self._unsupported("unload_lora_adapter")

    def lora_adapters(self) -> list[dict[str, Any]]:
        return []

    def control_status(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "weight_updates": 0, "paused": None}


class RunBasedEngine(NoControl):
    """Shared plumbing for engines with one code path ``_run(prompt_ids, sampling, stream=...)``
    yielding ``TokenDelta``s (the vLLM and TensorRT-LLM adapters), built as
    ``cls(model_dir, model_name=, context_window=, engine_args=)``."""

    _closed = False

    @classmethod
    def from_config(cls, config: Any, resolved: Any) -> Self:
        """The engine for a ``LocalBackendConfig`` (its ``engine_args``) and a ``ResolvedModel``."""
        engine = cls(  # type: ignore[call-arg]  # the adapters' constructors take these keywords
            resolved.path,
            model_name=resolved.name,
            context_window=config.max_model_len,
            engine_args=dict(config.engine_args or {}),
        )
        engine.pause_timeout = float(getattr(config, "pause_timeout", 300.0))  # type: ignore[attr-defined]
        return engine

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Generate to completion; see ``Engine.generate``."""
        return await collect(self._run(prompt_ids, sampling, stream=False))

    def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncGenerator[TokenDelta, None]:
        """Yield token deltas; closing the iterator early aborts the request."""
        return self._run(prompt_ids, sampling, stream=True)

    def _check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raises ``EngineError`` when the engine is shut down or the prompt is empty."""
        from gymserve.errors import EngineError

        if self._closed:
            raise EngineError("the engine is shut down")
        if not prompt_ids:
            raise EngineError("empty prompt")

    def _run(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, stream: bool
    ) -> AsyncGenerator[TokenDelta, None]:
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

    The control plane (names and modes as vLLM's ``AsyncLLM`` has them; engines that lack it
    inherit ``NoControl``): ``weight_version`` is the version now serving; ``pause_generation``
    stops sampling in one of the ``PauseMode``s until ``resume_generation`` or ``timeout`` seconds;
    ``update_weights`` swaps in a state dict (``tensors``: name → tensor) or the safetensors under
    ``path`` between two decode steps, all or nothing, and returns the new version;
    ``update_weight_version`` names the weights after the caller changed them itself;
    ``control_status()`` is ``{"weight_version", "weight_updates", "paused": mode | None, ...}``.
    Bad updates raise ``WeightUpdateError`` (400) and change nothing. LoRA adapters (PEFT format):
    ``load_lora_adapter(name, path)``, ``unload_lora_adapter(name)``, ``lora_adapters()`` (see
    ``engine.lora``).

    Optional capability: ``supports_prompt_logprobs`` (absent: false) says the engine honours
    ``SamplingParams.prompt_logprobs``; callers check it with ``check_prompt_logprobs``.
    """

    model_name: str
    model_type: str | None
    eos_token_ids: tuple[int, ...]
    context_window: int
    vocab_size: int
    weight_version: WeightVersion

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation: ...

    def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncGenerator[TokenDelta, None]:
        """Yield token deltas as they are sampled; closing the iterator cancels the generation."""
        ...

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def update_weights(
        self, tensors: Any = None, *, path: str | os.PathLike | None = None, weight_version: WeightVersion | None = None
    ) -> WeightVersion: ...

    async def update_weight_version(self, new_version: WeightVersion) -> None: ...

    async def load_lora_adapter(self, lora_name: str, lora_path: str | None = None, **kwargs: Any) -> WeightVersion: ...

    async def unload_lora_adapter(self, lora_name: str, **kwargs: Any) -> WeightVersion: ...

    def lora_adapters(self) -> list[dict[str, Any]]: ...

    def control_status(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
