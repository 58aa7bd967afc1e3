"""The llama.cpp engine: GGUF weights as they are stored, continuous batching, token-exact.

One worker thread owns a llama.cpp model and context (``llamacpp_runtime``). Each step it admits
waiting requests into free sequences of the KV cache and runs **one** ``llama_decode`` over every
active sequence: one token for each sequence that is decoding, and prompt chunks for those still
prefilling, up to ``n_batch`` tokens (llama-server's scheme). Tokens go back to each request's
asyncio queue as they are sampled, so the event loop never blocks and streaming is the same path.

Token-exact: the prompt arrives as token IDs (gymserve's template and prefix splice), never text.
Each sampled token's log-prob is ``log_softmax`` of the raw logits llama.cpp returned for that
position (before temperature/top-k/top-p); sampling follows ``engine.sampling``'s rules on numpy
(``sampling_numpy``), seeded per request. EOS and stop tokens end a generation and are part of it.

Session KV reuse: a sequence keeps its tokens' KV cache after its request ends. A new request takes
the free sequence whose cached tokens share the longest prefix with its prompt, drops the rest
(``llama_memory_seq_rm``) and prefills only what is new: the next turn of a rollout, whose prompt
starts with the previous prompt + generation (the on-policy splice), prefills only the turn's new
messages. With the unified KV pool (the default) idle sequences keep their cells until the pool is
full; then the least recently used idle sequences give theirs up, and when only running sequences
are left, the newest is preempted (its cells freed; it is recomputed from its tokens when cells are
free again, as vLLM's recompute preemption does). Tokens already sent are never taken back.

Prefix sharing across sequences (unified pool only): a prefilling sequence whose prompt starts with
tokens another sequence already holds takes those cells over instead of computing them again
(``llama_memory_seq_cp``: in the unified pool a cell may belong to several sequences, so this
copies no data), and one that shares a prefix of at least ``SHARE_MIN_TOKENS`` with a sequence
admitted before it, still prefilling, waits one step for that prefill. Rollouts of one task (the
same system prompt and tools; a GRPO group's identical prompts) then prefill their common prefix
once, as vLLM's automatic prefix caching and SGLang's radix cache do. The cells are what the
sequence's own prefill would compute: same tokens, same positions.

The control plane of a policy being trained (``engine.control``: pause modes, weight versions) runs
on the worker between two decode steps. A weight update loads a new GGUF file (``update_weights(path=)``)
or a LoRA adapter (``llamacpp_lora``); then every cached KV entry is dropped and running sequences
are recomputed on the new weights before their next token, so each token's log-prob is that of the
version that sampled it. What a weight update means for quantized weights: docs/model-servers/llamacpp.md.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gymserve.engine.base import FinishReason, SamplingParams, TokenDelta, WeightVersion
from gymserve.engine.control import Command, ControlState, check_timeout, check_version
from gymserve.engine.llamacpp_lora import LlamaCppLora
from gymserve.engine.llamacpp_runtime import (
    INSTALL_HINT,
    REBUILD_HINT,
    KVCacheFull,
    LlamaContext,
    LlamaCppScorer,
    LlamaModel,
    RuntimeOptions,
    check_gguf,
    common_prefix,
    log_normalizer,
)
from gymserve.engine.sampling_numpy import make_rng, sample_next, top_logprobs
from gymserve.engine.worker import WorkerEngine, WorkerRequest
from gymserve.errors import EngineError, NotSupportedError, WeightUpdateError

__all__ = ["ENGINE_ARGS", "INSTALL_HINT", "LlamaCppEngine", "check_engine_args", "gguf_eos_ids"]

ENGINE_ARGS: dict[str, str] = {
    "kv_cells": "KV cache cells in all (default: context_window, or context_window per sequence "
    "when kv_unified is false)",
    "kv_unified": "one KV pool shared by all sequences (default true); false: a fixed share each, "
    "as llama-server -np N",
    "cache_sessions": "sequences whose KV cache outlives their request, for the next turn (default "
    "4 × max_batch_size with the unified pool, else max_batch_size)",
    "n_batch": "most tokens per decode step, prompt chunks included (default 512)",
    "n_ubatch": "tokens per compute pass (default n_batch)",
    "n_threads_batch": "threads for prompt processing (default num_threads)",
    "flash_attn": "off (default), on or auto. On the CPU, llama.cpp's flash attention sums a sequence's "
    "attention in an order that depends on the other sequences in the KV pool, which moves its log-probs "
    "by ~1e-4 from teacher forcing; off, they agree to ~1e-7",
    "type_k": "K cache type: f16 (default), f32, q8_0",
    "type_v": "V cache type: f16 (default), f32, q8_0",
    "use_mmap": "map the GGUF file instead of reading it (default true)",
}


def check_engine_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` if every key is one of ``ENGINE_ARGS``; else ``ValueError`` listing them."""
    unknown = sorted(set(args) - set(ENGINE_ARGS))
    if unknown:
        raise ValueError(
            f"engine_args {', '.join(unknown)} not known to the llamacpp engine; it takes " + ", ".join(ENGINE_ARGS)
        )
    return dict(args)


def gguf_eos_ids(model: LlamaModel, tokenizer_dir: Path | None) -> tuple[int, ...]:
    """Every ID that ends a turn: ``generation_config.json``'s ``eos_token_id`` (int or list) in
    ``tokenizer_dir`` when it has one (what transformers reads, so both engines stop alike), else
    the GGUF's ``tokenizer.ggml.eos_token_id`` and ``tokenizer.ggml.eot_token_id``."""
    ids: list[int] = []
    gen = tokenizer_dir / "generation_config.json" if tokenizer_dir else None
    if gen is not None and gen.is_file():
        value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        ids = [int(i) for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)]
    if not ids:
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            value = model.meta(key)
            if value is not None and value.lstrip("-").isdigit() and int(value) >= 0:
                ids.append(int(value))
    if not ids:
        raise EngineError(f"{model.path} names no eos_token_id, and no generation_config.json gives one")
    return tuple(dict.fromkeys(ids))


@dataclass
class _Slot:
    """One sequence of the KV cache: the token IDs whose KV it holds (positions ``0..len-1``)."""

    seq_id: int
    cached: list[int] = field(default_factory=list)
    used: int = 0  # when it was last released (LRU order of idle slots)
    req: _Request | None = None


@dataclass
class _Request(WorkerRequest):
    rng: np.random.Generator | None = None
    tokens: list[int] = field(default_factory=list)  # sampled so far
    known: list[int] = field(default_factory=list)  # prompt + sampled: what the cache must hold to sample next
    slot: _Slot | None = None

    def __post_init__(self) -> None:
        self.known = [*self.prompt_ids, *self.tokens]

    def pending(self) -> list[int]:
        """The known tokens not yet in the slot's cache (the last one's logits give the next token)."""
        assert self.slot is not None
        return self.known[len(self.slot.cached) :]


SHARE_MIN_TOKENS = 32
"""A prefilling sequence waits a step for an earlier one's prefill when they share at least this
many tokens it does not hold yet (less is not worth the delay of a step)."""


class LlamaCppEngine(LlamaCppLora, WorkerEngine):
    """The ``Engine`` over a GGUF file, on llama.cpp (llama-cpp-python's low-level API).

    ``gguf``: the GGUF model file. ``tokenizer_dir``: the directory gymserve's tokenizer comes from
    (its ``generation_config.json``, when present, gives the EOS IDs; else the GGUF's).
    ``max_batch_size``: sequences decoded together; more requests wait. ``context_window``: most
    prompt + generation tokens per sequence (default: the model's trained context).
    ``num_threads``: decode threads (default: all cores). ``engine_args``: see ``ENGINE_ARGS``.
    ``pause_timeout``, ``weight_version``: as ``TransformersEngine``'s. Raises ``EngineError``
    when the file is not a GGUF llama.cpp can load, ``ValueError`` for unknown ``engine_args``,
    ``ImportError`` naming the install command when llama-cpp-python is missing.
    """

    engine_name = "llamacpp"

    @classmethod
    def resolve_model(cls, spec: str | None):
        """The GGUF file and tokenizer directory for ``--model`` (``gguf_store.resolve_gguf_model``)."""
        from gymserve.engine.gguf_store import resolve_gguf_model

        return resolve_gguf_model(spec)

    @staticmethod
    def load_tokenizer(path: str | os.PathLike):
        """The tokenizer in ``path`` as ``PreTrainedTokenizerFast`` (its ``tokenizer.json``, chat
        template and special tokens: what ``AutoTokenizer`` gives for Qwen2 and other fast
        tokenizers), loaded without the model classes, so this engine's process never imports torch.
        Falls back to ``AutoTokenizer`` for a directory without ``tokenizer.json``."""
        if (Path(path) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))

    @classmethod
    def from_config(cls, config, resolved) -> LlamaCppEngine:
        """The engine for a ``LocalBackendConfig`` and a ``ResolvedModel`` with ``gguf`` set."""
        if getattr(resolved, "gguf", None) is None:
            raise EngineError(
                f"the llamacpp engine runs a GGUF file, and {resolved.path} is not one; give --model a .gguf "
                "file, a directory holding one, or 'embedded'"
            )
        return cls(
            resolved.gguf,
            tokenizer_dir=resolved.path,
            engine_args=dict(config.engine_args or {}),
            **cls.config_args(config, resolved),
        )

    def __init__(
        self,
        gguf: str | os.PathLike,
        *,
        tokenizer_dir: str | os.PathLike | None = None,
        model_name: str | None = None,
        max_batch_size: int = 8,
        context_window: int | None = None,
        num_threads: int | None = None,
        weight_version: WeightVersion = 0,
        pause_timeout: float = 300.0,
        engine_args: Mapping[str, Any] | None = None,
    ):
        args = check_engine_args(engine_args or {})
        self.gguf = check_gguf(gguf)
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else None
        self.model_name = model_name or self.gguf.stem
        self.max_batch_size = int(max_batch_size)
        self.model = LlamaModel(self.gguf, use_mmap=bool(args.get("use_mmap", True)))
        self.vocab_size = self.model.vocab_size
        self.model_type = self._model_type()
        self.eos_token_ids = gguf_eos_ids(self.model, self.tokenizer_dir)
        self.context_window = int(context_window or self.model.n_ctx_train or 4096)
        unified = bool(args.get("kv_unified", True))
        sessions = int(args.get("cache_sessions") or (4 * self.max_batch_size if unified else self.max_batch_size))
        n_seq = min(max(sessions, self.max_batch_size), 256)  # llama.cpp's LLAMA_MAX_SEQ
        n_batch = int(args.get("n_batch", 512))
        self.options = RuntimeOptions(
            n_ctx=int(args.get("kv_cells") or (self.context_window * (1 if unified else n_seq))),
            n_seq_max=n_seq,
            kv_unified=unified,
            n_batch=n_batch,
            n_ubatch=int(args.get("n_ubatch", n_batch)),
            n_threads=num_threads,
            n_threads_batch=args.get("n_threads_batch") or num_threads,
            flash_attn=str(args.get("flash_attn", "off")),
            type_k=str(args.get("type_k", "f16")),
            type_v=str(args.get("type_v", "f16")),
            use_mmap=bool(args.get("use_mmap", True)),
        )
        try:
            self.ctx = LlamaContext(self.model, self.options)
        except BaseException:
            self.model.close()
            raise
        try:
            self._self_check()
        except BaseException:
            self.ctx.close()
            self.model.close()
            raise
        # A sequence never holds more than its share of the cache.
        self.context_window = min(self.context_window, self.ctx.n_ctx_seq)
        self.pause_timeout = check_timeout(pause_timeout)
        self._control = ControlState(check_version(weight_version))
        self._slots = [_Slot(i) for i in range(n_seq)]
        self._active: list[_Request] = []  # worker-only, in admission order
        self._released = itertools.count(1)
        self._update_lock: asyncio.Lock | None = None
        self.stats: collections.Counter[str] = collections.Counter()  # prefilled / reused / decoded tokens, preemptions
        self._start_worker(self._run, "gymserve-llamacpp")

    def _self_check(self) -> None:
        """One real ``llama_decode`` of one token before the engine takes calls, so a llama.cpp
        build whose kernels fail does so at start-up, not at the first rollout (the AMX build of
        ggml-org/llama.cpp#20824 is refused before this by ``llamacpp_runtime.check_build``; a crash
        here prints faulthandler's backtrace). Raises ``EngineError`` when the logits are not finite."""
        token = self.eos_token_ids[0] if self.eos_token_ids else 0
        logits = self.ctx.decode([token], [0], [0], [True])
        self.ctx.seq_rm(0)
        if logits.shape != (1, self.vocab_size) or not np.isfinite(logits).all():
            raise EngineError(
                f"llama.cpp's start-up self-check decoded one token of {self.gguf} and got non-finite logits: "
                "the build or the file is broken; rebuild llama-cpp-python: " + REBUILD_HINT
            )

    def teacher_forcer(self) -> LlamaCppScorer:
        """Teacher forcing on the weights this engine serves, without loading them again: a
        ``LlamaCppScorer`` sharing this engine's model (and LoRA adapter) with a context of its own.
        Use it between calls (it computes beside the worker otherwise) and close it before the next
        weight update, which frees the model it shares."""
        loaded = self._lora_state["loaded"]
        return LlamaCppScorer(
            self.model,
            n_threads=self.options.n_threads,
            adapter=loaded.adapter if loaded is not None else None,
            type_k=self.options.type_k,
            type_v=self.options.type_v,
            flash_attn=self.options.flash_attn,
        )

    def _model_type(self) -> str | None:
        """``config.json``'s ``model_type`` in the tokenizer directory, else the GGUF's
        ``general.architecture`` (llama.cpp's names match Hugging Face's for qwen2, llama, ...)."""
        cfg = self.tokenizer_dir / "config.json" if self.tokenizer_dir else None
        if cfg is not None and cfg.is_file():
            model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
            if model_type:
                return str(model_type)
        return self.model.architecture

    def _check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """``EngineError`` for an empty prompt, one that fills the context window, or a closed engine."""
        super()._check_prompt(prompt_ids)
        if len(prompt_ids) >= self.context_window:
            raise EngineError(
                f"the prompt has {len(prompt_ids)} tokens and the context window is {self.context_window}: "
                "no room to generate"
            )

    def _new_request(self, prompt_ids: list[int], sampling: SamplingParams, **common: Any) -> _Request:
        return _Request(prompt_ids, sampling, rng=make_rng(sampling), **common)

    # ---- control ---------------------------------------------------------------------------

    async def update_weights(
        self,
        tensors: Mapping[str, Any] | None = None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Serve the GGUF file ``path`` (or the one GGUF in directory ``path``) from the next decode
        step on; returns the new version. The new model loads beside the old one (both in memory for
        a moment), must have the same vocabulary, and takes over between two steps; cached KV is
        dropped and running sequences are recomputed on it. Raises ``WeightUpdateError`` (400) for a
        bad file (nothing changed), ``NotSupportedError`` (501) for ``tensors``: llama.cpp serves
        the GGUF file's quantized blocks, which a state dict cannot patch; write a GGUF
        (convert_hf_to_gguf.py) or push a LoRA adapter. ``ConflictError`` (409) while an adapter is loaded."""
        if tensors is not None:
            raise NotSupportedError(
                "update_weights with tensors is not supported by the llamacpp engine: it serves a GGUF file's "
                "quantized weights, which a state dict cannot patch in place. Write the new weights as a GGUF "
                "(llama.cpp's convert_hf_to_gguf.py) and pass its path, or push them as a LoRA adapter "
                "(POST /v1/load_lora_adapter)",
                code="control_not_supported",
            )
        if path is None:
            raise WeightUpdateError(
                "give path: a .gguf file (or a directory holding one) with the new weights", param="path"
            )
        version = None if weight_version is None else check_version(weight_version)
        self._refuse_while_lora("weight update")
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            t0 = asyncio.get_running_loop().time()
            model, ctx = await asyncio.to_thread(self._load_replacement, path)
            try:
                new = await self._send(Command("weights", apply=lambda: self._swap(model, ctx), version=version))
            except BaseException:
                if self.ctx is not ctx:  # the swap did not happen: free the unused copy
                    ctx.close()
                    model.close()
                raise
            self._control.last_update_seconds = asyncio.get_running_loop().time() - t0
        return new

    def _load_replacement(self, path: str | os.PathLike) -> tuple[LlamaModel, LlamaContext]:
        """A new model and context for ``path`` checked against the served one (off the worker)."""
        from gymserve.engine.gguf_store import find_gguf

        try:
            gguf = find_gguf(Path(path))
            model = LlamaModel(gguf, use_mmap=self.options.use_mmap)
        except (EngineError, OSError) as exc:
            raise WeightUpdateError(f"cannot load the new weights from {path}: {exc}", param="path") from exc
        problem = None
        if model.vocab_size != self.vocab_size:
            problem = f"its vocabulary has {model.vocab_size} tokens, the served model's {self.vocab_size}"
        elif model.architecture != self.model.architecture:
            problem = f"its architecture is {model.architecture}, the served model's {self.model.architecture}"
        if problem:
            model.close()
            raise WeightUpdateError(f"{gguf} cannot replace {self.gguf}: {problem}", param="path")
        try:
            return model, LlamaContext(model, self.options)
        except BaseException:
            model.close()
            raise

    def _swap(self, model: LlamaModel, ctx: LlamaContext) -> None:
        """On the worker: serve ``model`` through ``ctx``; free the old ones."""
        old_model, old_ctx = self.model, self.ctx
        self.model, self.ctx, self.gguf = model, ctx, model.path
        old_ctx.close()
        old_model.close()

    # ---- worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        ctl = self._control
        try:
            while True:
                if not self._serve_inbox():
                    return
                for r in [r for r in self._active if r.cancelled]:
                    self._release(r)
                try:
                    if ctl.admitting:
                        self._admit()
                    if self._active and ctl.decoding:
                        self._step()
                except Exception as exc:  # noqa: BLE001 - reported to the callers, never kills the worker
                    for r in list(self._active):
                        r.emit(exc)
                        self._release(r, forget=True)
                ctl.settle(len(self._active))
        finally:
            self.ctx.close()
            self.close_lora()
            self.model.close()

    def _running(self) -> list[_Request]:
        return self._active

    def _abort_running(self) -> None:
        for r in list(self._active):
            r.emit(TokenDelta([], [], "abort"))
            self._release(r)

    def _weights_changed(self, cmd: Command) -> None:
        """New weights (a GGUF file or an adapter): every cached KV entry is stale. Dropped here;
        running sequences are recomputed from their tokens by the next steps (all their tokens are
        then pending). A version name alone (``apply`` None) changes nothing llama.cpp computes."""
        if cmd.apply is not None:
            self.ctx.clear()
            for slot in self._slots:
                slot.cached = []
        self._control.stale = False  # recomputation is the pending tokens, not a separate pass

    def _drop_cache(self) -> int:
        """Every cached KV entry (finished sessions' and running sequences', which the next steps
        recompute from their tokens, as after new weights); the sequences that held some."""
        held = sum(1 for slot in self._slots if slot.cached)
        self.ctx.clear()
        for slot in self._slots:
            slot.cached = []
        return held

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_batch_size:
            req = self._waiting.popleft()
            if req.cancelled:
                continue
            slot = self._pick_slot(req.known)
            reuse = min(common_prefix(slot.cached, req.known), len(req.known) - 1)
            if reuse < len(slot.cached):
                self.ctx.seq_rm(slot.seq_id, reuse, -1)
                del slot.cached[reuse:]
            self.stats["reused"] += reuse
            slot.req, req.slot = req, slot
            self._active.append(req)

    def _pick_slot(self, tokens: list[int]) -> _Slot:
        """The free sequence whose cache shares the longest prefix with ``tokens``; among equals
        (no shared prefix included) an empty one, else the least recently used."""
        free = [s for s in self._slots if s.req is None]
        return max(free, key=lambda s: (common_prefix(s.cached, tokens), not s.cached, -s.used))

    def _release(self, req: _Request, *, forget: bool = False) -> None:
        """``req`` leaves the batch; its sequence keeps its cache for a later turn (``forget``: drop it)."""
        slot = req.slot
        if req in self._active:
            self._active.remove(req)
        if slot is None:
            return
        if forget:
            self.ctx.seq_rm(slot.seq_id)
            slot.cached = []
        slot.req, slot.used, req.slot = None, next(self._released), None

    def _share_prefix(self, req: _Request) -> None:
        """Give ``req``'s sequence the cells of the longest prefix of its tokens that another
        sequence holds beyond its own (unified pool: ``seq_cp`` tags the cells, copies nothing)."""
        slot = req.slot
        assert slot is not None
        have, best, donor = len(slot.cached), len(slot.cached), None
        for other in self._slots:
            if other is not slot and len(other.cached) > best:
                n = min(common_prefix(other.cached, req.known), len(req.known) - 1)
                if n > best:
                    best, donor = n, other
        if donor is not None:
            self.ctx.seq_cp(donor.seq_id, slot.seq_id, have, best)
            slot.cached += req.known[have:best]
            self.stats["shared"] += best - have

    def _waits_for_prefix(self, req: _Request, earlier: list[_Request]) -> bool:
        """Whether a sequence admitted before ``req`` is prefilling at least ``SHARE_MIN_TOKENS``
        of ``req``'s tokens that ``req`` does not hold yet: ``req`` takes them over a step later."""
        assert req.slot is not None
        have = len(req.slot.cached)
        for other in earlier:
            assert other.slot is not None
            shared = common_prefix(other.known, req.known)
            if shared - have >= SHARE_MIN_TOKENS and len(other.slot.cached) < shared:
                return True
        return False

    def _plan(self) -> list[tuple[_Request, list[int], int]]:
        """This step's work: ``(request, tokens to feed, first position)``, decoding sequences
        first, then prompt chunks in admission order, ``n_batch`` tokens in all; prefilling
        sequences first take over the prefix other sequences hold (unified pool)."""
        budget = self.ctx.n_batch
        plan: list[tuple[_Request, list[int], int]] = []
        share = self.options.kv_unified
        prefilling: list[_Request] = []
        for req in sorted(self._active, key=lambda r: len(r.pending()) > 1):
            if budget == 0:
                break
            assert req.slot is not None
            if share and len(req.pending()) > 1:
                self._share_prefix(req)
                waits = self._waits_for_prefix(req, prefilling)
                prefilling.append(req)
                if waits and plan:
                    continue
            todo = req.pending()[:budget]
            plan.append((req, todo, len(req.slot.cached)))
            budget -= len(todo)
        return plan

    def _step(self) -> None:
        for _ in range(len(self._slots) + len(self._active) + 1):  # each retry frees cells or a sequence
            plan = self._plan()
            tokens: list[int] = []
            pos: list[int] = []
            seqs: list[int] = []
            want: list[bool] = []
            for req, todo, start in plan:
                assert req.slot is not None
                last = start + len(todo) == len(req.known)  # the chunk ends at the newest token: sample
                tokens += todo
                pos += range(start, start + len(todo))
                seqs += [req.slot.seq_id] * len(todo)
                want += [False] * (len(todo) - 1) + [last]
            try:
                logits = self.ctx.decode(tokens, pos, seqs, want)
            except KVCacheFull:
                self._make_room()
                continue
            row = 0
            for req, todo, start in plan:
                assert req.slot is not None
                req.slot.cached += todo
                self.stats["decoded" if len(todo) == 1 and req.tokens else "prefilled"] += len(todo)
                if start + len(todo) == len(req.known):
                    self._accept(req, logits[row])
                    row += 1
            return
        raise EngineError("the KV cache stays full although every other sequence gave up its cells")

    def _make_room(self) -> None:
        """Free KV cells: the least recently used idle sequence's, else preempt the newest running
        one (back to the head of the queue; recomputed from its tokens when admitted again). Raises
        ``EngineError`` when a single sequence does not fit."""
        idle = [s for s in self._slots if s.req is None and s.cached]
        if idle:
            slot = min(idle, key=lambda s: s.used)
            self.ctx.seq_rm(slot.seq_id)
            slot.cached = []
            self.stats["evicted"] += 1
            return
        if len(self._active) > 1:
            victim = self._active[-1]
            self._release(victim, forget=True)
            self._waiting.appendleft(victim)
            self.stats["preempted"] += 1
            return
        raise EngineError(
            f"the KV cache ({self.ctx.n_ctx} cells) cannot hold this sequence; raise engine_args.kv_cells "
            "or lower max_model_len"
        )

    def _accept(self, req: _Request, logits: np.ndarray) -> None:
        """Sample from one position's raw logits and emit it; the request leaves when it finished."""
        if req.cancelled:
            self._release(req)
            return
        norm = float(log_normalizer(logits)[0])
        banned = req.ending.suppressed(len(req.tokens))
        scores = logits
        if banned:  # min_tokens: the stop set cannot be sampled yet (log-probs stay the raw ones)
            scores = logits.copy()
            scores[banned] = -np.inf
        tok = sample_next(scores, req.sampling, req.rng)
        req.tokens.append(tok)
        req.known.append(tok)
        finish: FinishReason | None = req.ending.finish(tok, len(req.tokens))
        if finish is None and len(req.known) >= self.context_window:
            finish = "length"
        tops = (
            [top_logprobs(logits.astype(np.float64) - norm, req.sampling.top_logprobs)]
            if req.sampling.top_logprobs
            else []
        )
        req.emit(TokenDelta([tok], [float(logits[tok]) - norm], finish, tops, self._control.weight_version))
        if finish:
            self._release(req)
