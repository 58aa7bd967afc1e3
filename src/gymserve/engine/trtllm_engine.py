"""The TensorRT-LLM engine: ``tensorrt_llm.LLM.generate_async`` fed ``{"prompt_token_ids": ...}``.

Like ``vllm_engine``, this adapter only maps ``SamplingParams`` onto TensorRT-LLM's and its
``RequestOutput`` back onto ``Generation`` / ``TokenDelta``; everything token-exact stays above it.

The mapping (``docs/model-servers/trtllm-engine.md`` has the parity argument):

- ``top_p`` and ``max_tokens`` as they are; ``top_k`` ``None``/``<= 0`` → ``0`` ("no top-k" there);
  ``temperature`` 0 (greedy) → ``top_k=1``, ``top_p=1``, no temperature, which is argmax in every
  TensorRT-LLM version (older ones reject ``temperature=0``).
- ``seed``: the request's; when unseeded, a fresh random seed per request, because TensorRT-LLM's
  runtime default seed is 0 for every request (identical samples for identical prompts), unlike
  vLLM and the transformers engine, where unseeded requests are independent.
- ``stop_token_ids`` with ``include_stop_str_in_output=True``: without it TensorRT-LLM cuts the stop
  token from ``token_ids`` but (in some versions) not from the log-probs; kept, the caller trims token
  and log-prob together. ``end_id`` is the model's first EOS ID; EOS-ended outputs keep the EOS.
- ``logprobs=max(1, top_logprobs)`` and ``logprobs_mode="raw_logprobs"`` where the version has it.
  Log-probs come as floats (the sampled token's) or as ``{token_id: Logprob(logprob, rank)}`` per
  position; both are read. Without ``logprobs_mode`` a version may report log-probs of the processed
  (temperature/top-k/top-p) distribution: the engine warns, and the docs say how to check.
- ``detokenize=False``; ``finish_reason`` ``"stop"``/``"length"`` map to themselves,
  ``"cancelled"``/``"timeout"`` are an ``EngineError``. Leaving a stream early calls
  ``RequestOutput.abort()``.

``tensorrt_llm`` is imported when a ``TRTLLMEngine`` is constructed; a missing package raises
``ImportError`` naming ``pip install tensorrt_llm``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gymserve.engine.base import RunBasedEngine, SamplingParams
from gymserve.engine.model_meta import read_model_meta
from gymserve.engine.request_output import RAW_LOGPROBS, accepts, output_deltas

log = logging.getLogger(__name__)

INSTALL_HINT = "the trtllm engine needs TensorRT-LLM, which is not installed: pip install tensorrt_llm"
# gymserve's engine_args names → TensorRT-LLM ``LLM`` argument names.
_RENAMED = {"max_model_len": "max_seq_len"}


def import_trtllm() -> SimpleNamespace:
    """TensorRT-LLM's classes the adapter uses; ``ImportError`` naming the package when missing."""
    try:
        from tensorrt_llm import LLM
        from tensorrt_llm import SamplingParams as TSamplingParams
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    try:
        from tensorrt_llm.llmapi import KvCacheConfig
    except ImportError:
        KvCacheConfig = None
    return SimpleNamespace(LLM=LLM, SamplingParams=TSamplingParams, KvCacheConfig=KvCacheConfig)


def trtllm_llm_kwargs(
    model_dir: Path, engine_args: dict[str, Any], context_window: int | None, kv_cache_config_cls: Any
) -> dict[str, Any]:
    """``tensorrt_llm.LLM`` keywords from gymserve's ``engine_args`` (vLLM names accepted).

    ``max_model_len`` → ``max_seq_len``; ``gpu_memory_utilization`` → ``kv_cache_config=
    KvCacheConfig(free_gpu_memory_fraction=...)`` (TensorRT-LLM's fraction is of the memory left
    free after the weights, vLLM's of the whole GPU); other keys pass through unchanged.
    """
    kwargs: dict[str, Any] = {"model": str(model_dir)}
    for key, value in engine_args.items():
        if key == "gpu_memory_utilization":
            if kv_cache_config_cls is None:
                raise ValueError(
                    "engine_args.gpu_memory_utilization needs tensorrt_llm.llmapi.KvCacheConfig, "
                    "which this TensorRT-LLM lacks"
                )
            kwargs["kv_cache_config"] = kv_cache_config_cls(free_gpu_memory_fraction=float(value))
        else:
            kwargs[_RENAMED.get(key, key)] = value
    if context_window and "max_seq_len" not in kwargs:
        kwargs["max_seq_len"] = int(context_window)
    return kwargs


def trtllm_sampling_kwargs(sampling: SamplingParams, *, end_id: int, seed: int | None = None) -> dict[str, Any]:
    """gymserve ``SamplingParams`` → ``tensorrt_llm.SamplingParams`` keywords (see module docstring).

    ``seed`` is used when ``sampling.seed`` is None (the engine passes a fresh random one).
    """
    greedy = sampling.temperature == 0
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": int(sampling.max_tokens),
        "end_id": int(end_id),
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
        "include_stop_str_in_output": True,
        "ignore_eos": False,
        "top_k": 1 if greedy else (int(sampling.top_k) if sampling.top_k is not None and sampling.top_k > 0 else 0),
        "top_p": 1.0 if greedy else float(sampling.top_p),
        "seed": int(sampling.seed) if sampling.seed is not None else seed,
        "logprobs": max(1, int(sampling.top_logprobs)),
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if not greedy:
        kwargs["temperature"] = float(sampling.temperature)
    return kwargs


class TRTLLMEngine(RunBasedEngine):
    """The ``Engine`` over ``tensorrt_llm.LLM`` (PyTorch backend by default) in this process.

    ``model_dir``: a Hugging Face model directory (or a built TensorRT engine directory with the
    model's ``config.json``). ``context_window``: passed as ``max_seq_len`` unless ``engine_args``
    names one. ``engine_args``: see ``trtllm_llm_kwargs``.
    """

    engine_name = "trtllm"  # in "not supported yet by the trtllm engine" (weight updates, pause)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        model_name: str | None = None,
        context_window: int | None = None,
        engine_args: dict[str, Any] | None = None,
    ):
        self._t = import_trtllm()
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        meta = read_model_meta(self.model_dir)
        self.eos_token_ids = meta.eos_token_ids
        self.vocab_size = meta.vocab_size
        self.model_type = meta.model_type
        self.end_id = meta.eos_token_ids[0]
        self.raw_logprobs = accepts(self._t.SamplingParams, "logprobs_mode")
        if not self.raw_logprobs:
            log.warning(
                "this TensorRT-LLM's SamplingParams has no logprobs_mode: its log-probs may be those of the "
                "processed distribution (after temperature/top-k/top-p), not gymserve's raw log-probs; they "
                "agree at temperature 1 with top_k and top_p off. Check with `gymserve verify-rollouts`."
            )
        kwargs = trtllm_llm_kwargs(self.model_dir, dict(engine_args or {}), context_window, self._t.KvCacheConfig)
        try:
            self.llm = self._t.LLM(**kwargs)
        except TypeError as exc:
            raise ValueError(f"engine_args not accepted by tensorrt_llm.LLM: {exc}") from exc
        llm_args = getattr(self.llm, "args", None)
        self.context_window = int(
            getattr(llm_args, "max_seq_len", None) or kwargs.get("max_seq_len") or meta.max_position_embeddings or 4096
        )
        self._closed = False

    def sampling_params(self, sampling: SamplingParams):
        """The ``tensorrt_llm.SamplingParams`` of one request."""
        kwargs = trtllm_sampling_kwargs(sampling, end_id=self.end_id, seed=secrets.randbits(63))
        if self.raw_logprobs:
            kwargs["logprobs_mode"] = RAW_LOGPROBS
        return self._t.SamplingParams(**kwargs)

    async def _run(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, stream: bool):
        self._check_prompt(prompt_ids)
        params = self.sampling_params(sampling)
        stop_ids = frozenset(self.eos_token_ids) | frozenset(sampling.stop_token_ids)
        result = self.llm.generate_async(
            {"prompt_token_ids": [int(t) for t in prompt_ids]}, sampling_params=params, streaming=stream
        )

        def readd_stop_token(comp, ids, lps, tops, finish):
            if finish == "stop" and _last(comp.token_ids) not in stop_ids:
                # The engine dropped the token that ended the turn (older builds leave end_id out):
                # put it back so the caller trims it; its log-prob is unknown.
                token = comp.stop_reason if isinstance(comp.stop_reason, int) else self.end_id
                log.warning("TensorRT-LLM left the stop token out of the output; re-adding %s", token)
                ids, lps = ids + [token], lps + [math.nan]
                tops = tops + [[]] if sampling.top_logprobs else tops
            return ids, lps, tops

        finished = False
        steps = result if stream else _once(result)
        try:
            async with aclosing(
                output_deltas(steps, "TensorRT-LLM", sampling.top_logprobs, cumulative=True, amend=readd_stop_token)
            ) as deltas:
                async for delta in deltas:
                    finished = delta.finish_reason is not None
                    yield delta
        finally:
            if not finished:
                try:
                    result.abort()
                except Exception as exc:  # noqa: BLE001 - the request may already be gone
                    log.debug("TensorRT-LLM abort: %s", exc)

    async def close(self) -> None:
        self._closed = True
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)


async def _once(result):
    """The finished result of a non-streaming request, as a one-step async iterator."""
    yield await result


def _last(ids: Sequence[int]) -> int | None:
    return int(ids[-1]) if len(ids) else None
