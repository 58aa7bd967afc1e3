"""The TensorRT-LLM engine: ``tensorrt_llm.LLM.generate_async`` fed ``{"prompt_token_ids": ...}``.

Like ``vllm_engine``, this adapter only maps ``SamplingParams`` onto TensorRT-LLM's and its
``RequestOutput`` back onto ``Generation`` / ``TokenDelta``; everything token-exact stays above it.

The mapping (``docs/model-servers/trtllm-engine.md`` has the parity argument):

- ``top_p``, ``min_p`` (when above 0; a 400 on a version without it) and ``max_tokens`` as they are; ``top_k`` ``None``/``<= 0`` → ``0`` ("no top-k" there);
  ``temperature`` 0 (greedy) → ``top_k=1``, ``top_p=1``, no temperature, which is argmax in every
  TensorRT-LLM version (older ones reject ``temperature=0``).
- ``seed``: the request's; when unseeded, a fresh random seed per request, because TensorRT-LLM's
  runtime default seed is 0 for every request (identical samples for identical prompts), unlike
  vLLM and the transformers engine, where unseeded requests are independent.
- ``stop_token_ids`` with ``include_stop_str_in_output=True``: without it TensorRT-LLM cuts the stop
  token from ``token_ids`` but (in some versions) not from the log-probs; kept, the stop token is a
  training token with its log-prob, as in vLLM. ``end_id`` is the model's first EOS ID; EOS-ended
  outputs keep the EOS (a build that leaves it out is logged once; its log-prob is never made up).
- ``logprobs=max(1, top_logprobs)`` and ``logprobs_mode="raw_logprobs"`` where the version has it.
  Log-probs come as floats (the sampled token's) or as ``{token_id: Logprob(logprob, rank)}`` per
  position; both are read. Without ``logprobs_mode`` a version may report log-probs of the processed
  (temperature/top-k/top-p) distribution: the engine warns, and the docs say how to check.
- ``detokenize=False``; ``finish_reason`` ``"stop"``/``"length"`` map to themselves,
  ``"cancelled"`` (``RequestOutput.abort()``: an abort pause) is an aborted answer that keeps its
  tokens, ``"timeout"`` is an ``EngineError``. Leaving a stream early calls ``RequestOutput.abort()``.

The control plane: TensorRT-LLM's ``LLM`` has no pause of its own, so the adapter pauses at its
door (``engine.pause_gate``): ``abort`` calls ``RequestOutput.abort()`` on the requests in flight
(they end as aborted answers with their tokens), ``wait`` returns once they finished, new requests
wait for resume; ``keep`` (freezing a request mid-generation) has no TensorRT-LLM counterpart: 501.
Weight updates use TensorRT-LLM's RL worker extension (``tensorrt_llm/llmapi/rlhf_utils.py``, the
LLM built with ``engine_args: {orchestrator_type: ray, ray_worker_extension_cls:
tensorrt_llm.llmapi.rlhf_utils.WorkerExtension}``): ``LLM._collective_rpc("update_weights",
(ipc_handles,))`` with ``{device_uuid: [(name, reduce_tensor(tensor)), ...]}`` for each GPU of the
tensor-parallel group, then ``("update_weights", (None,))`` to finalize (the extension reloads the
named tensors, a subset or all, and waits for the requests in flight first). ``path`` is read as
safetensors (``engine.weights``). LoRA: a ``LoRARequest(lora_name, lora_int_id, lora_path)`` goes
with every ``generate_async`` (the LLM built with LoRA support), one adapter at a time
(``library_control``).

``tensorrt_llm`` is imported when a ``TRTLLMEngine`` is constructed; a missing package raises
``ImportError`` naming ``pip install tensorrt_llm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gymserve.engine.base import PauseMode, RunBasedEngine, SamplingParams, WeightVersion
from gymserve.engine.control import check_mode, check_timeout, check_version
from gymserve.engine.library_control import LibraryControl, LoadedLora, library_error
from gymserve.engine.model_meta import read_model_meta
from gymserve.engine.pause_gate import Call, PauseGate
from gymserve.engine.request_output import RAW_LOGPROBS, accepts, output_deltas
from gymserve.errors import NotSupportedError, WeightUpdateError

RLHF_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"

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
    try:
        from tensorrt_llm.executor.request import LoRARequest
    except ImportError:
        LoRARequest = None
    return SimpleNamespace(
        LLM=LLM, SamplingParams=TSamplingParams, KvCacheConfig=KvCacheConfig, LoRARequest=LoRARequest
    )


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
        "ignore_eos": bool(sampling.ignore_eos),
        **({"min_tokens": int(sampling.min_tokens)} if sampling.min_tokens else {}),
        "top_k": 1 if greedy else (int(sampling.top_k) if sampling.top_k is not None and sampling.top_k > 0 else 0),
        "top_p": 1.0 if greedy else float(sampling.top_p),
        **({"min_p": float(sampling.min_p)} if sampling.min_p > 0 and not greedy else {}),
        "seed": int(sampling.seed) if sampling.seed is not None else seed,
        "logprobs": max(1, int(sampling.top_logprobs)),
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if not greedy:
        kwargs["temperature"] = float(sampling.temperature)
    return kwargs


class TRTLLMEngine(LibraryControl, RunBasedEngine):
    """The ``Engine`` over ``tensorrt_llm.LLM`` (PyTorch backend by default) in this process.

    ``model_dir``: a Hugging Face model directory (or a built TensorRT engine directory with the
    model's ``config.json``). ``context_window``: passed as ``max_seq_len`` unless ``engine_args``
    names one. ``engine_args``: see ``trtllm_llm_kwargs``.
    """

    engine_name = "trtllm"
    _warned_dropped_eos = False  # set on the instance the first time a build leaves the EOS out

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
        self._closed, self._owned = False, True
        self._rlhf = kwargs.get("ray_worker_extension_cls") == RLHF_EXTENSION
        self._tp = int(kwargs.get("tensor_parallel_size") or 1)
        self._init_control()
        self._pause_gate: PauseGate | None = None

    @classmethod
    def around(cls, llm: Any, *, model_name: str | None = None) -> TRTLLMEngine:
        """The adapter over a ``tensorrt_llm.LLM`` the trainer built and keeps (``serve_policy``):
        its ``args`` give the model directory (EOS IDs, vocabulary), ``max_seq_len``, the tensor
        parallel size and whether the RL worker extension is loaded; ``close()`` leaves it running."""
        self = cls.__new__(cls)
        self._t = import_trtllm()
        args = getattr(llm, "args", None)
        self.model_dir = Path(str(getattr(args, "model", "") or "."))
        self.model_name = model_name or self.model_dir.name
        meta = read_model_meta(self.model_dir)
        self.eos_token_ids, self.vocab_size, self.model_type = meta.eos_token_ids, meta.vocab_size, meta.model_type
        self.end_id = meta.eos_token_ids[0]
        self.raw_logprobs = accepts(self._t.SamplingParams, "logprobs_mode")
        self.llm = llm
        self.context_window = int(getattr(args, "max_seq_len", None) or meta.max_position_embeddings or 4096)
        self._closed, self._owned = False, False
        self._rlhf = getattr(args, "ray_worker_extension_cls", None) == RLHF_EXTENSION
        self._tp = int(getattr(args, "tensor_parallel_size", None) or 1)
        self._init_control()
        self._pause_gate = None
        return self

    @property
    def gate(self) -> PauseGate:
        """The door requests pass (created on first use, once ``pause_timeout`` is set)."""
        if self._pause_gate is None:
            self._pause_gate = PauseGate(name="the trtllm engine", default_timeout=self.pause_timeout)
        return self._pause_gate

    def sampling_params(self, sampling: SamplingParams):
        """The ``tensorrt_llm.SamplingParams`` of one request; ``InvalidRequestError`` (400) for a
        ``min_p`` this TensorRT-LLM's ``SamplingParams`` has no field for (never silently dropped)."""
        kwargs = trtllm_sampling_kwargs(sampling, end_id=self.end_id, seed=secrets.randbits(63))
        if "min_p" in kwargs and not accepts(self._t.SamplingParams, "min_p"):
            from gymserve.errors import InvalidRequestError

            raise InvalidRequestError(
                "min_p is not applied by this TensorRT-LLM (its SamplingParams has no min_p); omit it", param="min_p"
            )
        if self.raw_logprobs:
            kwargs["logprobs_mode"] = RAW_LOGPROBS
        return self._t.SamplingParams(**kwargs)

    async def _run(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, stream: bool):
        self._check_prompt(prompt_ids)
        params = self.sampling_params(sampling)
        stop_ids = frozenset(self.eos_token_ids) | frozenset(sampling.stop_token_ids)
        async with self.gate.call() as call:
            lora = {"lora_request": self._lora.request} if self._lora is not None else {}
            result = self.llm.generate_async(
                {"prompt_token_ids": [int(t) for t in prompt_ids]}, sampling_params=params, streaming=stream, **lora
            )
            watcher = asyncio.ensure_future(_abort_on(call, result))
            try:
                async with aclosing(self._deltas(result, sampling, stop_ids, stream)) as deltas:
                    async for delta in deltas:
                        yield delta
            finally:
                watcher.cancel()

    async def _deltas(self, result: Any, sampling: SamplingParams, stop_ids: frozenset, stream: bool):

        def note_dropped_stop_token(comp, ids, lps, tops, finish):
            if finish == "stop" and _last(comp.token_ids) not in stop_ids and not self._warned_dropped_eos:
                # Older builds leave end_id out of the output. Its log-prob is not known, so it is not
                # made up: the generation ends without it (the splice's template EOS closes the
                # turn) and the trainer gets no gradient for stopping, which the log says once.
                self._warned_dropped_eos = True
                log.warning(
                    "TensorRT-LLM left the EOS that ended a generation out of its output: generation_token_ids "
                    "end without it and its log-prob is unknown; use a TensorRT-LLM build that keeps end_id"
                )
            return ids, lps, tops

        finished = False
        steps = result if stream else _once(result)
        try:
            async with aclosing(
                output_deltas(
                    steps,
                    "TensorRT-LLM",
                    sampling.top_logprobs,
                    cumulative=True,
                    amend=note_dropped_stop_token,
                    aborts=("cancelled",),
                )
            ) as deltas:
                async for delta in deltas:
                    finished = delta.finish_reason is not None
                    delta.weight_version = self.weight_version
                    yield delta
        finally:
            if not finished:
                try:
                    result.abort()
                except Exception as exc:  # noqa: BLE001 - the request may already be gone
                    log.debug("TensorRT-LLM abort: %s", exc)

    # ---- control plane (see the module docstring) ------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """Pause at the adapter's door: ``abort`` aborts the requests in flight, ``wait`` lets them
        finish first; ``keep`` is 501 (TensorRT-LLM cannot freeze a request)."""
        mode = check_mode(mode)
        timeout = None if timeout is None else check_timeout(timeout)
        if mode == "keep":
            raise NotSupportedError(
                "the trtllm engine cannot keep requests frozen mid-generation (TensorRT-LLM's LLM has no such "
                "pause); pause with mode=wait (they finish) or mode=abort (they end, keeping their tokens)",
                code="control_not_supported",
            )
        await self.gate.pause(mode, timeout, abort_in_flight=True, drain=mode == "wait")

    async def resume_generation(self) -> None:
        self.gate.resume()

    async def is_paused(self) -> bool:
        return self.gate.paused is not None

    def control_status(self) -> dict[str, Any]:
        gate = self.gate.status()
        return {**super().control_status(), "paused": gate["paused"], "pause_seconds_left": gate["pause_seconds_left"]}

    async def update_weights(
        self,
        tensors: Mapping[str, Any] | None = None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """New weights through TensorRT-LLM's RL worker extension (see the module docstring)."""
        from gymserve.engine.weights import read_safetensors

        if not self._rlhf:
            raise NotSupportedError(
                "weight updates on the trtllm engine need TensorRT-LLM's RL worker extension: set engine_args "
                f"orchestrator_type: ray and ray_worker_extension_cls: {RLHF_EXTENSION}",
                code="control_not_supported",
            )
        if (tensors is None) == (path is None):
            raise WeightUpdateError("give exactly one of tensors (a state dict) and path (a safetensors directory)")
        version = self._next_version(weight_version)
        async with self._lock():
            t0 = time.perf_counter()
            if path is not None:
                tensors = await asyncio.to_thread(read_safetensors, path)
            assert tensors is not None
            rpc = self.llm._collective_rpc
            try:
                handles, _keep = await asyncio.to_thread(ipc_handles, tensors, range(self._tp))
                await asyncio.to_thread(rpc, "update_weights", (handles,))
                await asyncio.to_thread(rpc, "update_weights", (None,))
            except Exception as exc:
                raise library_error(exc, "TensorRT-LLM", "the weight update") from exc
            return self._changed(version, t0)

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        """Name the weights (TensorRT-LLM keeps no version: the adapter does)."""
        self._changed(check_version(new_version, "new_version"), time.perf_counter())

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
        """The PEFT adapter at ``lora_path`` serves every following request (TensorRT-LLM loads it
        with the first one; the LLM needs LoRA support: ``engine_args.lora_config``)."""
        path = self._check_lora_load(lora_name, lora_path, tensors, load_inplace)
        if self._t.LoRARequest is None:
            raise NotSupportedError("this TensorRT-LLM has no LoRARequest", code="control_not_supported")
        version = self._next_version(weight_version)
        async with self._lock():
            t0 = time.perf_counter()
            int_id = self._new_lora_id(lora_name, load_inplace=False)  # a new id: TensorRT-LLM caches by id
            request = self._t.LoRARequest(lora_name, int_id, str(path))
            self._lora = LoadedLora(lora_name, int_id, str(path), request, version)
            return self._changed(version, t0)

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        self._check_lora_unload(lora_name)
        version = self._next_version(weight_version)
        async with self._lock():
            self._lora = None
            return self._changed(version, time.perf_counter())

    async def close(self) -> None:
        self._closed = True
        if self._pause_gate is not None:
            self._pause_gate.close()
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None and self._owned:
            await asyncio.to_thread(shutdown)


def ipc_handles(tensors: Mapping[str, Any], devices: Any) -> tuple[dict[str, list], list]:
    """``({device_uuid: [(name, reduce_tensor(tensor)), ...]}, copies)``: what TensorRT-LLM's
    ``WorkerExtension.update_weights`` rebuilds on each GPU of ``devices`` (the copies must live
    until it has). ``reduce_tensor`` is PyTorch's (``torch.multiprocessing.reductions``): a CUDA
    IPC handle for a GPU tensor."""
    import torch
    from tensorrt_llm._torch.utils import get_device_uuid
    from torch.multiprocessing.reductions import reduce_tensor

    handles: dict[str, list] = {}
    copies = []
    for device in devices:
        entries = []
        for name, tensor in tensors.items():
            t = tensor.detach()
            if torch.cuda.is_available():
                t = t.to(f"cuda:{device}")
            t = t.contiguous()
            copies.append(t)
            entries.append((name, reduce_tensor(t)))
        handles[get_device_uuid(device)] = entries
    return handles, copies


async def _abort_on(call: Call, result: Any) -> None:
    """Abort ``result`` (TensorRT-LLM's request) when an abort pause ends ``call``."""
    await call.aborted.wait()
    with contextlib.suppress(Exception):
        result.abort()


async def _once(result):
    """The finished result of a non-streaming request, as a one-step async iterator."""
    yield await result


def _last(ids: Sequence[int]) -> int | None:
    return int(ids[-1]) if len(ids) else None
