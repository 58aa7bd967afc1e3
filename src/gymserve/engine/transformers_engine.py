"""A transformers engine with continuous batching on CPU (or one GPU).

One worker thread owns the model. Requests arrive on a thread-safe queue; each step the worker
admits waiting requests (prefilling each alone, so a prompt's KV entries are exactly those of a
single-sequence forward pass), merges their KV cache into the running batch by left-padding, and
runs one batched decode step for every active sequence. Finished or cancelled sequences leave the
batch between steps. Tokens go back to each request's asyncio queue as they are sampled, so the
event loop never blocks on the model and streaming falls out of the same path.

Log-probs are ``log_softmax`` of the logits the model produced for the sampled position (see
``sampling.py``); padding is masked out of attention, so they match a teacher-forced forward pass
over prompt + generation to float32 rounding. Prompt log-probs (``SamplingParams.prompt_logprobs``)
come from the prefill itself, asked for the logits of every prompt position: the same forward pass
that samples the first token, so on the same weights.

Serving a policy being trained: pause/resume, weight updates and versions run on the same worker
thread, between two decode steps (``engine.control`` has the state machine, ``engine.weights`` the
reading and validation), so no forward pass sees a half-loaded model. After the weights change, the
KV cache of calls still in the batch is recomputed on the new weights (one single-sequence prefill
each, as at admission) before their next step.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gymserve.engine.base import FinishReason, PromptLogprobs, SamplingParams, TokenDelta, WeightVersion
from gymserve.engine.control import ControlState, check_timeout, check_version
from gymserve.engine.lora import LoraEngine
from gymserve.engine.sampling import make_generator, prompt_logprobs, sample_next, top_logprobs
from gymserve.engine.worker import WorkerEngine, WorkerRequest


@dataclass
class _Request(WorkerRequest):
    generator: torch.Generator | None = None
    generated: int = 0
    tokens: list[int] = field(default_factory=list)  # sampled so far (to recompute the KV cache)
    next_token: int | None = None  # sampled, not yet fed to the model
    seq_len: int = 0  # tokens of this sequence in the cache (prompt + fed generation)
    prompt_logprobs: PromptLogprobs | None = None  # computed at prefill, sent with the first token
    constraint: Any = None  # the call's TokenConstraint (structured output), from sampling.constraint


@dataclass
class _Batch:
    """The running batch: its calls, their DynamicCache (grown in place by each decode step) and
    the ``[B, T]`` attention mask (1 = real token, 0 = left padding)."""

    active: list[_Request] = field(default_factory=list)
    cache: Any = None
    mask: torch.Tensor | None = None

    def clear(self) -> None:
        self.active, self.cache, self.mask = [], None, None


class TransformersEngine(LoraEngine, WorkerEngine):
    """The ``Engine`` over a Hugging Face causal LM directory.

    ``model_dir``: a directory ``AutoModelForCausalLM`` loads (config + safetensors).
    ``max_batch_size``: concurrent sequences per decode step; more requests wait in the queue.
    ``context_window``: defaults to the config's ``max_position_embeddings``.
    ``num_threads``: torch intra-op threads (default: all cores).
    ``model``: serve this already loaded causal LM instead of loading ``model_dir`` (a trainer's own
    copy; ``model_dir`` then only names it and supplies ``generation_config.json`` when present).
    ``weight_version``: the version of the weights it starts with. ``pause_timeout``: seconds a
    pause lasts when the caller gives no timeout. LoRA adapters merge into the weights
    (``engine.lora``).
    """

    engine_name = "transformers"
    supports_prompt_logprobs = True
    supports_structured_output = True  # applies SamplingParams.constraint (a token mask per step)

    @classmethod
    def from_config(cls, config, resolved) -> TransformersEngine:
        """The engine for a ``LocalBackendConfig`` and a ``model_store.ResolvedModel``."""
        return cls(resolved.path, **cls.config_args(config, resolved))

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model_name: str | None = None,
        max_batch_size: int = 8,
        context_window: int | None = None,
        num_threads: int | None = None,
        dtype: str = "float32",
        model: Any = None,
        weight_version: WeightVersion = 0,
        pause_timeout: float = 300.0,
    ):
        from transformers import GenerationConfig

        from gymserve.engine.hf_models import load_causal_lm

        if model_dir is None and model is None:
            raise ValueError("TransformersEngine needs model_dir (a model directory) or model (a loaded causal LM)")
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        cfg_path = model_dir or getattr(getattr(model, "config", None), "_name_or_path", None) or ""
        self.model_dir = Path(cfg_path)
        self.model_name = model_name or self.model_dir.name or "policy"
        self.model = model if model is not None else load_causal_lm(str(model_dir), dtype=getattr(torch, dtype))
        self.model.eval()
        cfg = self.model.config
        self.model_type = getattr(cfg, "model_type", None) or None
        self.vocab_size = int(cfg.vocab_size)
        max_positions: int = getattr(cfg, "max_position_embeddings", 4096)  # an int in every HF config
        self.context_window = int(context_window or max_positions)
        eos: set[int] = set()
        try:
            gen_cfg = GenerationConfig.from_pretrained(str(cfg_path)) if cfg_path else None
            ids = gen_cfg.eos_token_id if gen_cfg is not None else cfg.eos_token_id
        except OSError:
            ids = cfg.eos_token_id
        for i in ids if isinstance(ids, list) else [ids]:
            if i is not None:
                eos.add(int(i))
        self.eos_token_ids = tuple(sorted(eos))
        self.max_batch_size = max_batch_size
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept both.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pause_timeout = check_timeout(pause_timeout)
        self._control = ControlState(check_version(weight_version))
        self._update_lock: asyncio.Lock | None = None
        self._batch = _Batch()
        self._start_worker(self._run, "gymserve-engine")

    def teacher_forcer(self) -> Any:
        """Teacher forcing on the weights this engine serves, without loading them again: the served
        causal LM itself (float32 by default, a merged LoRA adapter included), which
        ``harness.verify`` runs forward passes on. Use it between calls: a forward pass beside the
        worker's shares its cores."""
        return self.model

    def _new_request(self, prompt_ids: list[int], sampling: SamplingParams, **common: Any) -> _Request:
        constraint = sampling.constraint() if sampling.constraint is not None else None
        return _Request(prompt_ids, sampling, generator=make_generator(sampling), constraint=constraint, **common)

    # ---- worker thread ---------------------------------------------------------------------

    def _running(self) -> list[_Request]:
        return self._batch.active

    def _abort_running(self) -> None:
        for r in self._batch.active:
            r.emit(TokenDelta([], [], "abort"))
        self._batch.clear()

    def _run(self) -> None:
        batch = self._batch
        ctl = self._control
        with torch.inference_mode():
            while True:
                if not self._serve_inbox():
                    return
                if not batch.active:
                    ctl.stale = False
                elif ctl.stale and ctl.decoding:
                    self._guarded(batch, self._recompute)
                if ctl.admitting:
                    self._admit(batch)
                if batch.active and ctl.decoding:
                    self._guarded(batch, self._step)
                ctl.settle(len(batch.active))

    def _guarded(self, batch: _Batch, step) -> None:
        """Run ``step(batch)``; a failure ends every call in the batch with the error."""
        try:
            step(batch)
        except Exception as exc:  # noqa: BLE001
            for r in batch.active:
                r.emit(exc)
            batch.clear()

    def _admit(self, batch: _Batch) -> None:
        admitted: list[tuple[_Request, Any]] = []
        while self._waiting and len(batch.active) + len(admitted) < self.max_batch_size:
            req = self._waiting.popleft()
            if req.cancelled:
                continue
            try:
                req_kv = self._prefill(req)
            except Exception as exc:  # noqa: BLE001 - reported to the caller, never kills the worker
                req.emit(exc)
                continue
            if req.next_token is not None:  # else it finished on its first token
                admitted.append((req, req_kv))
        if admitted:
            # The cache is rebuilt only when the batch changes; decode steps extend it in place.
            kv = _layers(batch.cache) if batch.cache is not None else None
            mask = batch.mask
            for req, req_kv in admitted:
                kv, mask = self._merge(kv, mask, req_kv, req.seq_len)
                batch.active.append(req)
            batch.cache, batch.mask = self._new_cache(kv), mask

    def _recompute(self, batch: _Batch) -> None:
        """The batch's KV cache again, on the current weights: each call's prompt and fed tokens
        (its last sampled token is fed by the next step), one single-sequence prefill each."""
        kv = mask = None
        for r in batch.active:
            req_kv, _, _ = self._encode((r.prompt_ids + r.tokens)[: r.seq_len])
            kv, mask = self._merge(kv, mask, req_kv, r.seq_len)
        batch.cache, batch.mask = self._new_cache(kv), mask
        self._control.stale = False

    def _step(self, batch: _Batch) -> None:
        keep, batch.mask = self._decode_step(batch.active, batch.cache, batch.mask)
        if len(keep) != len(batch.active):
            batch.active = [batch.active[i] for i in keep]
            if batch.active:
                idx = torch.tensor(keep)
                kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in _layers(batch.cache)]
                kv, batch.mask = self._compact(kv, batch.mask.index_select(0, idx))
                batch.cache = self._new_cache(kv)
            else:
                batch.clear()

    def _new_cache(self, kv):
        from transformers import DynamicCache

        return DynamicCache(kv) if kv is not None else DynamicCache()

    def _forward(self, input_ids, attention_mask, position_ids, cache, *, every_position: bool = False):
        """One forward pass; ``cache`` is extended in place. Returns the last position's logits
        ``[B, vocab]`` (float32), or with ``every_position`` all of them, ``[B, T, vocab]``."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=0 if every_position else 1,
            **{self._cache_kw: cache},
        )
        return out.logits if every_position else out.logits[:, -1, :].float()

    def _encode(self, token_ids: list[int], prompt_top: int | None = None):
        """One single-sequence forward pass: its per-layer KV, the last position's logits and, when
        ``prompt_top`` is not None, the tokens' own log-probs with that many alternatives."""
        ids = torch.tensor([token_ids])
        n = ids.shape[1]
        cache = self._new_cache(None)
        every = prompt_top is not None
        logits = self._forward(ids, torch.ones_like(ids), torch.arange(n).unsqueeze(0), cache, every_position=every)
        if prompt_top is None:
            return _layers(cache), logits[0], None
        return _layers(cache), logits[0, -1].float(), prompt_logprobs(logits[0], token_ids, prompt_top)

    def _prefill(self, req: _Request):
        kv, logits, req.prompt_logprobs = self._encode(req.prompt_ids, req.sampling.prompt_logprobs)
        req.seq_len = len(req.prompt_ids)
        self._accept(req, logits)
        return kv

    def _accept(self, req: _Request, logits: torch.Tensor) -> bool:
        """Sample from one position's logits, emit it; True while the sequence goes on."""
        if req.cancelled:
            req.next_token = None
            return False
        logprobs = torch.log_softmax(logits, dim=-1)
        banned = req.ending.suppressed(req.generated)
        if banned:  # min_tokens: the stop set cannot be sampled yet (log-probs stay the raw ones)
            logits = logits.index_fill(0, torch.tensor(banned), float("-inf"))
        if req.constraint is not None:  # structured output: only what the grammar allows next
            logits = req.constraint.mask(logits)
        tok = sample_next(logits, req.sampling, req.generator)
        if req.constraint is not None:
            req.constraint.accept(tok)
        req.generated += 1
        finish: FinishReason | None = req.ending.finish(tok, req.generated)
        tops = [top_logprobs(logprobs, req.sampling.top_logprobs)] if req.sampling.top_logprobs else []
        req.tokens.append(tok)
        version = self._control.weight_version
        req.emit(TokenDelta([tok], [float(logprobs[tok])], finish, tops, version, req.prompt_logprobs))
        req.prompt_logprobs = None  # sent with the first token only
        req.next_token = None if finish else tok
        return finish is None

    def _merge(self, kv, mask, req_kv, length):
        new_mask = torch.ones(1, length, dtype=torch.long)
        if kv is None:
            return req_kv, new_mask
        cur = mask.shape[1]
        if length < cur:
            req_kv = [(_left_pad(k, cur - length), _left_pad(v, cur - length)) for k, v in req_kv]
            new_mask = torch.cat([torch.zeros(1, cur - length, dtype=torch.long), new_mask], dim=1)
        elif length > cur:
            kv = [(_left_pad(k, length - cur), _left_pad(v, length - cur)) for k, v in kv]
            mask = torch.cat([torch.zeros(mask.shape[0], length - cur, dtype=torch.long), mask], dim=1)
        kv = [(torch.cat([k, rk]), torch.cat([v, rv])) for (k, v), (rk, rv) in zip(kv, req_kv)]
        return kv, torch.cat([mask, new_mask])

    def _decode_step(self, active: list[_Request], cache, mask) -> tuple[list[int], torch.Tensor]:
        """One batched decode step; returns the indices of sequences that go on, and the new mask."""
        ids = torch.tensor([[r.next_token] for r in active])
        pos = torch.tensor([[r.seq_len] for r in active])
        mask = torch.cat([mask, torch.ones(len(active), 1, dtype=torch.long)], dim=1)
        logits = self._forward(ids, mask, pos, cache)
        keep = []
        for i, r in enumerate(active):
            r.seq_len += 1
            if self._accept(r, logits[i]):
                keep.append(i)
        return keep, mask

    @staticmethod
    def _compact(kv, mask):
        """Drop leading columns that are padding for every remaining sequence."""
        real = mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else 0
        if start == 0:
            return kv, mask
        return [(k[:, :, start:], v[:, :, start:]) for k, v in kv], mask[:, start:]


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` tensors ``[B, H, T, D]`` of a DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Left-pad a ``[B, H, T, D]`` cache tensor with ``n`` zero positions along T."""
    pad = torch.zeros(t.shape[0], t.shape[1], n, t.shape[3], dtype=t.dtype)
    return torch.cat([pad, t], dim=2)
