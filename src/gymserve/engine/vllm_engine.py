"""The vLLM engine: ``AsyncLLM`` (vLLM's V1 async engine) fed prompt token IDs.

Everything token-exact stays above this file (templating, prefix splice, sampling params, context
clamp, which tokens' text is shown); this adapter only maps ``SamplingParams`` onto vLLM's and vLLM's
``RequestOutput`` back onto ``Generation`` / ``TokenDelta``.

The mapping (see ``docs/model-servers/vllm-engine.md`` for the parity argument):

- ``temperature`` (0 is greedy in both), ``top_p``, ``min_p``, ``seed``, ``max_tokens`` as they are; ``top_k``
  ``None``/``<= 0`` → ``-1`` ("off"; every vLLM version accepts it); ``stop_token_ids`` as they are,
  ``min_tokens`` and ``ignore_eos`` as they are (``engine.ending`` states the same rule). vLLM applies temperature, then min-p, then top-k, then top-p,
  the order ``engine.sampling`` follows.
- ``logprobs=top_logprobs`` (0 when none): vLLM always adds the sampled token's entry, so every
  position has it. The engine runs with ``logprobs_mode="raw_logprobs"`` (set explicitly where the
  version has the argument; it is vLLM's default): the log-prob of the raw model distribution,
  before temperature/top-k/top-p, which is gymserve's contract.
- ``detokenize=False``: gymserve decodes text itself; vLLM's detokenizer would be wasted work.
- Output: ``CompletionOutput.token_ids`` include the EOS or stop token that ended the generation
  (vLLM's ``check_stop`` leaves it in place; only stop *strings* are cut, and gymserve sends none),
  with its log-prob, as the ``Generation`` contract wants. ``finish_reason`` ``"stop"``/``"length"``
  map to themselves; ``"abort"`` (a pause with mode ``abort``, from gymserve or from a trainer that
  paused its ``AsyncLLM`` itself) is an aborted answer that keeps its tokens; anything else is an
  ``EngineError``. Each token carries the weight version serving when it arrived.
- Every call asks for ``RequestOutputKind.DELTA`` (new tokens as each step makes them), the
  non-streamed ones too: each token is stamped with the weight version serving when it arrives, so
  a call that a ``keep`` pause carried across an update gets its ``weight_version_spans`` whether
  streamed or not (``FINAL_ONLY`` would deliver every token at the end, all stamped with the last
  version). Versions without ``output_kind`` stream cumulative outputs and are diffed here.
- ``prompt_logprobs=k`` (vLLM's own field, computed in the same forward pass as the first sampled
  token) when ``SamplingParams.prompt_logprobs`` asks: vLLM's first output carries them, a
  ``{token_id: Logprob(logprob, rank)}`` per prompt position (``None`` at position 0), which map
  onto ``PromptLogprobs``: the prompt token's log-prob and rank, and the ``k`` best by rank.
- Leaving a stream early (client disconnect) closes vLLM's generator and calls
  ``engine.abort(request_id)``, which frees the sequence's KV blocks.

The control plane maps onto ``AsyncLLM``'s own RL API (``vllm/v1/engine/async_llm.py``):

- ``pause_generation(mode)`` → ``AsyncLLM.pause_generation(mode=...)`` (abort / wait / keep; a
  vLLM before ``mode`` has ``wait_for_inflight_requests`` and no keep); ``resume_generation`` and
  ``is_paused`` → its own. vLLM has no pause deadline: the adapter resumes by itself when it passes.
- ``update_weights(path=DIR)``: where the engine was built with a ``disk`` weight transfer
  (``engine_args: {weight_transfer_config: {backend: disk}}``, a backend some vLLM builds register)
  → ``start_weight_update()``, ``update_weights(WeightTransferUpdateRequest(update_info={"path":
  DIR}))``, ``finish_weight_update(weight_version=str(v))``. Otherwise (vLLM 0.32 registers no
  ``disk`` backend: ``weight_transfer_config: {backend: disk}`` stops it from starting with
  ``Invalid weight transfer backend: disk``) → ``collective_rpc("reload_weights",
  kwargs={"weights_path": DIR})``, each worker's in-place reload of a complete checkpoint
  (``vllm/model_executor/model_loader/reload``), then ``update_weight_version(str(v))``. In-process
  ``tensors`` are written to a temporary safetensors directory first (the engine core runs in
  another process). vLLM's ``ValueError`` / ``FileNotFoundError`` for a checkpoint it refuses is a
  400 ``invalid_weights``.
- ``update_weight_version(v)`` → ``AsyncLLM.update_weight_version(str(v))``.
- LoRA: ``add_lora(LoRARequest(lora_name, lora_int_id, lora_path, load_inplace))`` /
  ``remove_lora(lora_int_id)`` (``--enable-lora``: ``engine_args: {enable_lora: true,
  max_lora_rank: R}``), and every generation passes the loaded adapter's ``lora_request``: one
  adapter at a time serves as the policy (``library_control``).

The engine object and the two vLLM modules are imported when a ``VLLMEngine`` is constructed, so
gymserve installs and imports without vLLM; a missing vLLM raises ``ImportError`` naming
``pip install vllm``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gymserve.engine.base import PauseMode, PromptLogprobs, RunBasedEngine, SamplingParams, WeightVersion
from gymserve.engine.control import check_mode, check_timeout, check_version
from gymserve.engine.library_control import LibraryControl, LoadedLora, library_error
from gymserve.engine.model_meta import read_model_meta
from gymserve.engine.request_output import RAW_LOGPROBS, accepts, output_deltas, position_logprob
from gymserve.errors import NotSupportedError, WeightUpdateError

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
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
    except ImportError:  # a vLLM before the weight transfer API: update_weights answers 501
        WeightTransferUpdateRequest = None
    try:
        from vllm.lora.request import LoRARequest
    except ImportError:
        LoRARequest = None
    return SimpleNamespace(
        SamplingParams=VSamplingParams,
        AsyncEngineArgs=AsyncEngineArgs,
        TokensPrompt=TokensPrompt,
        AsyncLLM=AsyncLLM,
        RequestOutputKind=RequestOutputKind,
        WeightTransferUpdateRequest=WeightTransferUpdateRequest,
        LoRARequest=LoRARequest,
    )


def vllm_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """gymserve ``SamplingParams`` → keyword arguments of ``vllm.SamplingParams`` (see module docstring)."""
    return {
        "n": 1,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k is not None and sampling.top_k > 0 else -1,
        "min_p": float(sampling.min_p),
        "seed": sampling.seed,
        "max_tokens": int(sampling.max_tokens),
        "min_tokens": int(sampling.min_tokens),
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
        "ignore_eos": bool(sampling.ignore_eos),
        "logprobs": int(sampling.top_logprobs),
        "detokenize": False,
        "skip_special_tokens": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }


async def _tap_prompt_logprobs(outputs: Any, seen: list[Any]):
    """``outputs`` as they are; the first non-empty ``prompt_logprobs`` among them goes into ``seen``."""
    async for out in outputs:
        if not seen and getattr(out, "prompt_logprobs", None):
            seen.append(out.prompt_logprobs)
        yield out


def vllm_prompt_logprobs(positions: Sequence[Any], prompt_ids: Sequence[int], k: int) -> PromptLogprobs:
    """vLLM's ``RequestOutput.prompt_logprobs`` → ``PromptLogprobs``. ``positions``: one entry per
    prompt token, ``None`` at position 0, else ``{token_id: Logprob(logprob, rank)}`` holding the
    prompt token and the ``k`` most likely (vLLM's ranks: 1 is the most likely). Raises
    ``EngineError`` when vLLM's list does not cover the prompt or a prompt token is missing."""
    from gymserve.errors import EngineError

    entries = list(positions)
    if len(entries) != len(prompt_ids):
        raise EngineError(f"vLLM returned {len(entries)} prompt log-probs for a prompt of {len(prompt_ids)} tokens")
    out = PromptLogprobs(log_probs=[None], ranks=[None], top_logprobs=[[]])
    for i in range(1, len(entries)):
        pos, tok = entries[i], int(prompt_ids[i])
        entry = pos.get(tok) if pos is not None else None
        if entry is None:
            raise EngineError(f"vLLM returned no prompt log-prob for the prompt token {tok} at position {i}")
        lp, tops = position_logprob(pos, tok, k, "vLLM")
        out.log_probs.append(lp)
        rank = getattr(entry, "rank", None)
        out.ranks.append(int(rank) if rank is not None else None)
        out.top_logprobs.append(tops)
    return out


class VLLMEngine(LibraryControl, RunBasedEngine):
    """The ``Engine`` over vLLM's ``AsyncLLM`` in this process.

    ``model_dir``: a Hugging Face model directory. ``context_window``: passed as ``max_model_len``
    unless ``engine_args`` names one; the engine's effective ``max_model_len`` becomes
    ``context_window``. ``engine_args``: ``AsyncEngineArgs`` keywords (``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ...); ``logprobs_mode`` other than
    ``raw_logprobs`` is refused.
    """

    engine_name = "vllm"
    supports_prompt_logprobs = True  # vLLM's prompt_logprobs (module docstring)

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
        self._closed, self._owned = False, True
        self._init_control()

    @classmethod
    def around(cls, async_llm: Any, *, model_name: str | None = None) -> VLLMEngine:
        """The adapter over an ``AsyncLLM`` the trainer built and keeps (``serve_policy``): its
        model directory (``model_config.model``) gives the EOS IDs and vocabulary, its
        ``max_model_len`` the context window; ``close()`` leaves it running. Raises ``ValueError``
        when it reports other log-probs than raw ones (``logprobs_mode``)."""
        self = cls.__new__(cls)
        self._v = import_vllm()
        model_config = getattr(async_llm, "model_config", None)
        mode = getattr(model_config, "logprobs_mode", RAW_LOGPROBS)
        if str(getattr(mode, "value", mode)) != RAW_LOGPROBS:
            raise ValueError(
                f"this AsyncLLM reports {mode!r} log-probs; gymserve reports raw log-probs (the policy's "
                f"distribution before temperature/top-k/top-p): build it with logprobs_mode={RAW_LOGPROBS!r}"
            )
        self.model_dir = Path(str(getattr(model_config, "model", "") or "."))
        self.model_name = model_name or self.model_dir.name
        meta = read_model_meta(self.model_dir)
        self.eos_token_ids, self.vocab_size, self.model_type = meta.eos_token_ids, meta.vocab_size, meta.model_type
        self.engine = async_llm
        self.context_window = int(getattr(model_config, "max_model_len", None) or meta.max_position_embeddings or 4096)
        self._closed, self._owned = False, False
        self._init_control()
        return self

    def sampling_params(self, sampling: SamplingParams, *, stream: bool):
        """The ``vllm.SamplingParams`` of one request: DELTA outputs whether streamed or not (per-token
        versions, see the module docstring), and ``prompt_logprobs`` when asked for."""
        kwargs = vllm_sampling_kwargs(sampling)
        kind = self._v.RequestOutputKind
        if kind is not None:
            kwargs["output_kind"] = kind.DELTA
        if sampling.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = int(sampling.prompt_logprobs)
        return self._v.SamplingParams(**kwargs)

    async def _run(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, stream: bool):
        self._check_prompt(prompt_ids)
        params = self.sampling_params(sampling, stream=stream)
        delta_mode = self._v.RequestOutputKind is not None
        request_id = f"gymserve-{uuid.uuid4().hex}"
        ids = [int(t) for t in prompt_ids]
        prompt = self._v.TokensPrompt(prompt_token_ids=ids)
        lora = {"lora_request": self._lora.request} if self._lora is not None else {}
        outputs = self.engine.generate(prompt, params, request_id, **lora)
        seen_prompt: list[Any] = []  # vLLM's prompt_logprobs, from the first output that has them
        k = sampling.prompt_logprobs
        finished = False
        try:
            # Cumulative outputs unless vLLM sends deltas.
            async with aclosing(
                output_deltas(
                    _tap_prompt_logprobs(outputs, seen_prompt),
                    "vLLM",
                    sampling.top_logprobs,
                    cumulative=not delta_mode,
                    aborts=("abort",),
                )
            ) as deltas:
                async for delta in deltas:
                    finished = delta.finish_reason is not None
                    delta.weight_version = self.weight_version
                    if k is not None and seen_prompt and seen_prompt[0] is not None:
                        delta.prompt_logprobs = vllm_prompt_logprobs(seen_prompt[0], ids, k)
                        seen_prompt[0] = None  # on the first delta only
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

    @property
    def fault(self) -> str | None:
        """Why vLLM's engine is dead (``AsyncLLM.errored``: its engine-core process died, and vLLM
        answers every call with ``EngineDeadError``), else None. The local backend's ``/health``
        then reports ``down`` with this reason, and new calls get 503 ``engine_down``."""
        if not getattr(self.engine, "errored", False):
            return None
        err = getattr(self.engine, "dead_error", None)
        return f"{type(err).__name__}: {err}" if err is not None else "vLLM reports its engine errored"

    async def close(self) -> None:
        """Refuse new calls; shut vLLM down unless the trainer owns it (``around``)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None and self._owned:
            shutdown()

    # ---- control plane (see the module docstring) ------------------------------------------------

    def _needs(self, what: str, method: str) -> Any:
        fn = getattr(self.engine, method, None)
        if fn is None:
            raise NotSupportedError(
                f"{what} needs AsyncLLM.{method}, which this vLLM lacks; upgrade vLLM (its RL API: pause_generation, "
                "start_weight_update / update_weights / finish_weight_update)",
                code="control_not_supported",
            )
        return fn

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """``AsyncLLM.pause_generation`` in ``mode``; resumes by itself after ``timeout`` s."""
        mode = check_mode(mode)
        timeout = None if timeout is None else check_timeout(timeout)
        pause = self._needs("pause_generation", "pause_generation")
        if accepts(pause, "mode"):
            await pause(mode=mode)
        elif mode == "keep":
            raise NotSupportedError(
                "this vLLM's pause_generation has no keep mode (it has wait_for_inflight_requests only); "
                "pause with mode=abort or mode=wait, or upgrade vLLM",
                code="control_not_supported",
            )
        else:
            await pause(wait_for_inflight_requests=mode == "wait")
        self._paused_for(mode, timeout)

    async def resume_generation(self) -> None:
        await self._needs("resume_generation", "resume_generation")()
        self._resumed()

    async def is_paused(self) -> bool:
        fn = getattr(self.engine, "is_paused", None)
        return bool(await fn()) if fn is not None else self._paused is not None

    async def update_weights(
        self, tensors: Any = None, *, path: str | os.PathLike | None = None, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """New weights through vLLM's disk weight transfer; returns the new version (see the module
        docstring). Raises ``WeightUpdateError`` (400) with vLLM's words for a checkpoint it refuses."""
        if (tensors is None) == (path is None):
            raise WeightUpdateError("give exactly one of tensors (a state dict) and path (a safetensors directory)")
        disk = self.weight_transfer_backend() == "disk"
        if disk:
            start = self._needs("update_weights", "start_weight_update")
        else:
            rpc = self._needs("update_weights (vLLM's reload_weights)", "collective_rpc")
        version = self._next_version(weight_version)
        request_cls = self._v.WeightTransferUpdateRequest
        async with self._lock():
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="gymserve-vllm-update-") as tmp:
                if tensors is not None:
                    await asyncio.to_thread(_save_safetensors, tensors, Path(tmp))
                where = os.path.abspath(os.fspath(path if path is not None else tmp))
                # Checked here because a reload that fails part way leaves vLLM 0.32's engine dead.
                if not Path(where).is_dir() or not any(Path(where).glob("*.safetensors")):
                    raise WeightUpdateError(
                        f"{where} is not a safetensors checkpoint directory (no *.safetensors in it)", param="path"
                    )
                try:
                    if disk:
                        await start()
                        await self.engine.update_weights(request_cls(update_info={"path": where}))
                        await self.engine.finish_weight_update(weight_version=str(version))
                    else:
                        await rpc("reload_weights", kwargs={"weights_path": where})
                        await self._needs("update_weights", "update_weight_version")(str(version))
                except Exception as exc:
                    raise library_error(exc, "vLLM", f"the weight update from {where}") from exc
            return self._changed(version, t0)

    def weight_transfer_backend(self) -> str | None:
        """The ``weight_transfer_config.backend`` vLLM was built with (None: none configured)."""
        config = getattr(getattr(self.engine, "vllm_config", None), "weight_transfer_config", None)
        backend = getattr(config, "backend", None)
        return str(backend) if backend is not None else None

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        version = check_version(new_version, "new_version")
        await self._needs("update_weight_version", "update_weight_version")(str(version))
        self._changed(version, time.perf_counter())

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
        """``AsyncLLM.add_lora`` of the PEFT directory ``lora_path``; it then serves every call."""
        path = self._check_lora_load(lora_name, lora_path, tensors, load_inplace)
        config = getattr(self.engine, "vllm_config", None)
        if config is not None and getattr(config, "lora_config", "unknown") is None:
            raise NotSupportedError(
                "this vLLM engine was started without LoRA: set backend.engine_args enable_lora: true and "
                "max_lora_rank (at least the adapter's rank), then restart",
                code="control_not_supported",
            )
        version = self._next_version(weight_version)
        async with self._lock():
            t0 = time.perf_counter()
            int_id = self._new_lora_id(lora_name, load_inplace)
            kwargs: dict[str, Any] = {"lora_name": lora_name, "lora_int_id": int_id, "lora_path": str(path)}
            if accepts(self._v.LoRARequest, "load_inplace"):
                kwargs["load_inplace"] = load_inplace
            request = self._v.LoRARequest(**kwargs)
            try:
                added = await self._needs("load_lora_adapter", "add_lora")(request)
            except Exception as exc:
                raise library_error(exc, "vLLM", f"loading LoRA adapter {lora_name!r}") from exc
            if added is False:
                raise WeightUpdateError(f"vLLM did not load LoRA adapter {lora_name!r} from {path}", param="lora_path")
            old = self._lora
            if old is not None and old.int_id != int_id:
                await self.engine.remove_lora(old.int_id)
            self._lora = LoadedLora(lora_name, int_id, str(path), request, version)
            return self._changed(version, t0)

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """``AsyncLLM.remove_lora`` of the adapter serving now; the base model serves again."""
        current = self._check_lora_unload(lora_name)
        version = self._next_version(weight_version)
        async with self._lock():
            t0 = time.perf_counter()
            await self._needs("unload_lora_adapter", "remove_lora")(current.int_id)
            self._lora = None
            return self._changed(version, t0)


def _save_safetensors(tensors: Any, where: Path) -> None:
    """``tensors`` (a state dict) as ``model.safetensors`` in ``where`` (CPU, contiguous; tied
    tensors saved once each name, as safetensors wants no shared storage)."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(where / "model.safetensors")
    )
