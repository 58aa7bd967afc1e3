"""A transformers engine with continuous batching on CPU (or one GPU).

One worker thread owns the model. Requests arrive on a thread-safe queue; each step the worker
admits waiting requests (prefilling each alone, so a prompt's KV entries are exactly those of a
single-sequence forward pass), merges their KV cache into the running batch by left-padding, and
runs one batched decode step for every active sequence. Finished or cancelled sequences leave the
batch between steps. Tokens go back to each request's asyncio queue as they are sampled, so the
event loop never blocks on the model and streaming falls out of the same path.

Log-probs are ``log_softmax`` of the logits the model produced for the sampled position (see
``sampling.py``); padding is masked out of attention, so they match a teacher-forced forward pass
over prompt + generation to float32 rounding.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gymserve.engine.base import Generation, SamplingParams, TokenDelta, collect
from gymserve.engine.sampling import make_generator, sample_next, top_logprobs
from gymserve.errors import EngineError


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    generated: int = 0
    next_token: int | None = None  # sampled, not yet fed to the model
    cancelled: bool = False
    seq_len: int = 0  # tokens of this sequence in the cache (prompt + fed generation)
    id: int = field(default_factory=itertools.count().__next__)

    def emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class TransformersEngine:
    """The ``Engine`` over a Hugging Face causal LM directory.

    ``model_dir``: a directory ``AutoModelForCausalLM`` loads (config + safetensors).
    ``max_batch_size``: concurrent sequences per decode step; more requests wait in the queue.
    ``context_window``: defaults to the config's ``max_position_embeddings``.
    ``num_threads``: torch intra-op threads (default: all cores).
    """

    @classmethod
    def from_config(cls, config, resolved) -> TransformersEngine:
        """The engine for a ``LocalBackendConfig`` and a ``model_store.ResolvedModel``."""
        return cls(resolved.path, model_name=resolved.name, max_batch_size=config.max_batch_size,
                   context_window=config.context_window, num_threads=config.num_threads)

    def __init__(self, model_dir: str | Path, *, model_name: str | None = None, max_batch_size: int = 8,
                 context_window: int | None = None, num_threads: int | None = None, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        self.model.eval()
        cfg = self.model.config
        self.model_type = getattr(cfg, "model_type", None) or None
        self.vocab_size = int(cfg.vocab_size)
        self.context_window = int(context_window or getattr(cfg, "max_position_embeddings", 4096))
        eos: set[int] = set()
        try:
            gen_cfg = GenerationConfig.from_pretrained(str(model_dir))
            ids = gen_cfg.eos_token_id
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
        self._inbox: queue.Queue[_Request | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gymserve-engine", daemon=True)
        self._thread.start()

    # ---- async API -------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Generate to completion; see ``Engine.generate``."""
        return await collect(self.stream(prompt_ids, sampling))

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Yield one ``TokenDelta`` per sampled token; leaving the loop early cancels the request."""
        if self._closed:
            raise EngineError("the engine is shut down")
        if not prompt_ids:
            raise EngineError("empty prompt")
        req = _Request(
            prompt_ids=list(prompt_ids), sampling=sampling, loop=asyncio.get_running_loop(),
            out=asyncio.Queue(), stop_ids=frozenset(self.eos_token_ids) | frozenset(sampling.stop_token_ids),
            generator=make_generator(sampling),
        )
        self._inbox.put(req)
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"generation failed: {type(item).__name__}: {item}") from item
                yield item
                if item.finish_reason:
                    return
        finally:
            req.cancelled = True  # no-op when finished; stops work when the client went away

    async def close(self) -> None:
        self._closed = True
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    # ---- worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        active: list[_Request] = []
        cache = None  # DynamicCache of the running batch, grown in place by each decode step
        mask: torch.Tensor | None = None  # [B, T] 1 = real token, 0 = left padding
        with torch.inference_mode():
            while True:
                block = not active
                admitted = []
                while len(active) + len(admitted) < self.max_batch_size:
                    try:
                        req = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if req is None:
                        self._drain(active + [r for r, _ in admitted])
                        return
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
                    kv = _layers(cache) if cache is not None else None
                    for req, req_kv in admitted:
                        kv, mask = self._merge(kv, mask, req_kv, req.seq_len)
                        active.append(req)
                    cache = self._new_cache(kv)
                if not active:
                    continue
                try:
                    keep, mask = self._decode_step(active, cache, mask)
                except Exception as exc:  # noqa: BLE001
                    for r in active:
                        r.emit(exc)
                    active, cache, mask = [], None, None
                    continue
                if len(keep) != len(active):
                    active = [active[i] for i in keep]
                    if active:
                        idx = torch.tensor(keep)
                        kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in _layers(cache)]
                        kv, mask = self._compact(kv, mask.index_select(0, idx))
                        cache = self._new_cache(kv)
                    else:
                        cache, mask = None, None

    def _drain(self, active: list[_Request]) -> None:
        err = EngineError("the engine shut down during generation")
        for r in active:
            r.emit(err)
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if req is not None:
                req.emit(err)

    def _new_cache(self, kv):
        from transformers import DynamicCache

        return DynamicCache(kv) if kv is not None else DynamicCache()

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        """One forward pass; ``cache`` is extended in place. Returns the last position's logits."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def _prefill(self, req: _Request):
        ids = torch.tensor([req.prompt_ids])
        n = ids.shape[1]
        cache = self._new_cache(None)
        logits = self._forward(ids, torch.ones_like(ids), torch.arange(n).unsqueeze(0), cache)
        req.seq_len = n
        self._accept(req, logits[0])
        return _layers(cache)

    def _accept(self, req: _Request, logits: torch.Tensor) -> bool:
        """Sample from one position's logits, emit it; True while the sequence goes on."""
        if req.cancelled:
            req.next_token = None
            return False
        logprobs = torch.log_softmax(logits, dim=-1)
        tok = sample_next(logits, req.sampling, req.generator)
        req.generated += 1
        finish = None
        if tok in req.stop_ids:
            finish = "stop"
        elif req.generated >= req.sampling.max_tokens:
            finish = "length"
        tops = [top_logprobs(logprobs, req.sampling.top_logprobs)] if req.sampling.top_logprobs else []
        req.emit(TokenDelta([tok], [float(logprobs[tok])], finish, tops))
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
