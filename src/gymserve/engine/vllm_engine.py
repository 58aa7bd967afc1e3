"""The vLLM engine: ``AsyncLLM`` (vLLM's V1 async engine) fed prompt token IDs.

Everything token-exact stays above this file (templating, prefix splice, pinned sampling, context
clamp, stop-token trimming); this adapter only maps ``SamplingParams`` onto vLLM's and vLLM's
``RequestOutput`` back onto ``Generation`` / ``TokenDelta``.

The mapping (see ``docs/model-servers/vllm-engine.md`` for the parity argument):

- ``temperature`` (0 is greedy in both), ``top_p``, ``seed``, ``max_tokens`` as they are; ``top_k``
  ``None``/``<= 0`` → ``-1`` ("off"; every vLLM version accepts it); ``stop_token_ids`` as they are,
  with ``ignore_eos=False`` and ``min_tokens=0``. vLLM applies temperature, then top-k, then top-p,
  the order ``engine.sampling`` follows.
- ``logprobs=top_logprobs`` (0 when none): vLLM always adds the sampled token's entry, so every
  position has it. The engine runs with ``logprobs_mode="raw_logprobs"`` (set explicitly where the
  version has the argument; it is vLLM's default): the log-prob of the raw model distribution,
  before temperature/top-k/top-p, which is gymserve's contract.
- ``detokenize=False``: gymserve decodes text itself; vLLM's detokenizer would be wasted work.
- Output: ``CompletionOutput.token_ids`` include the EOS or stop token that ended the generation
  (vLLM's ``check_stop`` leaves it in place; only stop *strings* are cut, and gymserve sends none),
  with its log-prob, as the ``Generation`` contract wants. ``finish_reason`` ``"stop"``/``"length"``
  map to themselves; ``"abort"`` (or anything else) is an ``EngineError``.
- Streaming asks for ``RequestOutputKind.DELTA`` (new tokens only); ``generate`` asks for
  ``FINAL_ONLY``. Versions without ``output_kind`` stream cumulative outputs and are diffed here.
- Leaving a stream early (client disconnect) closes vLLM's generator and calls
  ``engine.abort(request_id)``, which frees the sequence's KV blocks.

The engine object and the two vLLM modules are imported when a ``VLLMEngine`` is constructed, so
gymserve installs and imports without vLLM; a missing vLLM raises ``ImportError`` naming
``pip install vllm``.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gymserve.engine.base import RunBasedEngine, SamplingParams
from gymserve.engine.model_meta import read_model_meta
from gymserve.engine.request_output import RAW_LOGPROBS, accepts, output_deltas

log = logging.getLogger(__name__)

INSTALL_HINT = "the vllm engine needs vLLM, which is not installed: pip install vllm"


def import_vllm() -> SimpleNamespace:
    """vLLM's classes the adapter uses; ``ImportError`` naming ``pip install vllm`` when missing."""
    try:
        from vllm import SamplingParams as VSamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # older releases: the V0 engine class has the same generate/abort API
        from vllm import AsyncLLMEngine as AsyncLLM
    try:
        from vllm.sampling_params import RequestOutputKind
    except ImportError:
        RequestOutputKind = None
    return SimpleNamespace(
        SamplingParams=VSamplingParams,
        AsyncEngineArgs=AsyncEngineArgs,
        TokensPrompt=TokensPrompt,
        AsyncLLM=AsyncLLM,
        RequestOutputKind=RequestOutputKind,
    )


def vllm_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """gymserve ``SamplingParams`` → keyword arguments of ``vllm.SamplingParams`` (see module docstring)."""
    return {
        "n": 1,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k is not None and sampling.top_k > 0 else -1,
        "min_p": 0.0,
        "seed": sampling.seed,
        "max_tokens": int(sampling.max_tokens),
        "min_tokens": 0,
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
        "ignore_eos": False,
        "logprobs": int(sampling.top_logprobs),
        "detokenize": False,
        "skip_special_tokens": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }


class VLLMEngine(RunBasedEngine):
    """The ``Engine`` over vLLM's ``AsyncLLM`` in this process.

    ``model_dir``: a Hugging Face model directory. ``context_window``: passed as ``max_model_len``
    unless ``engine_args`` names one; the engine's effective ``max_model_len`` becomes
    ``context_window``. ``engine_args``: ``AsyncEngineArgs`` keywords (``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ...); ``logprobs_mode`` other than
    ``raw_logprobs`` is refused.
    """

    engine_name = "vllm"  # in "not supported yet by the vllm engine" (weight updates, pause)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        model_name: str | None = None,
        context_window: int | None = None,
        engine_args: dict[str, Any] | None = None,
    ):
        self._v = import_vllm()
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        meta = read_model_meta(self.model_dir)
        self.eos_token_ids = meta.eos_token_ids
        self.vocab_size = meta.vocab_size
        self.model_type = meta.model_type
        args = dict(engine_args or {})
        mode = args.get("logprobs_mode", RAW_LOGPROBS)
        if mode != RAW_LOGPROBS:
            raise ValueError(
                f"engine_args.logprobs_mode={mode!r}: gymserve reports raw log-probs (the policy's "
                f"distribution before temperature/top-k/top-p); use {RAW_LOGPROBS!r} or leave it out"
            )
        engine_args_cls = self._v.AsyncEngineArgs
        if accepts(engine_args_cls, "logprobs_mode"):
            args["logprobs_mode"] = RAW_LOGPROBS
        else:
            args.pop("logprobs_mode", None)
            log.info("this vLLM has no logprobs_mode engine argument; its V1 sampler reports raw log-probs")
        if context_window and "max_model_len" not in args:
            args["max_model_len"] = int(context_window)
        try:
            eargs = engine_args_cls(model=str(self.model_dir), **args)
        except TypeError as exc:
            raise ValueError(f"engine_args not accepted by vLLM's AsyncEngineArgs: {exc}") from exc
        self.engine = self._v.AsyncLLM.from_engine_args(eargs)
        model_config = getattr(self.engine, "model_config", None)
        self.context_window = int(
            getattr(model_config, "max_model_len", None)
            or args.get("max_model_len")
            or meta.max_position_embeddings
            or 4096
        )
        self._closed = False

    def sampling_params(self, sampling: SamplingParams, *, stream: bool):
        """The ``vllm.SamplingParams`` of one request (DELTA outputs when streaming, else FINAL_ONLY)."""
        kwargs = vllm_sampling_kwargs(sampling)
        kind = self._v.RequestOutputKind
        if kind is not None:
            kwargs["output_kind"] = kind.DELTA if stream else kind.FINAL_ONLY
        return self._v.SamplingParams(**kwargs)

    async def _run(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, stream: bool):
        self._check_prompt(prompt_ids)
        params = self.sampling_params(sampling, stream=stream)
        delta_mode = stream and self._v.RequestOutputKind is not None
        request_id = f"gymserve-{uuid.uuid4().hex}"
        prompt = self._v.TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        outputs = self.engine.generate(prompt, params, request_id)
        finished = False
        try:
            # Cumulative or final-only outputs unless vLLM sends deltas.
            async with aclosing(
                output_deltas(outputs, "vLLM", sampling.top_logprobs, cumulative=not delta_mode)
            ) as deltas:
                async for delta in deltas:
                    finished = delta.finish_reason is not None
                    yield delta
        finally:
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()  # vLLM's generator aborts the request itself when closed early
            if not finished:
                await self._abort(request_id)

    async def _abort(self, request_id: str) -> None:
        try:
            res = self.engine.abort(request_id)
            if inspect.isawaitable(res):
                await res
        except Exception as exc:  # noqa: BLE001 - aborting a request that already ended is harmless
            log.debug("vLLM abort of %s: %s", request_id, exc)

    async def close(self) -> None:
        self._closed = True
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
