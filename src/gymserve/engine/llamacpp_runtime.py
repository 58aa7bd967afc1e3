"""llama.cpp through llama-cpp-python's low-level (ctypes) API: one GGUF model, one context, many
sequences decoded in one ``llama_decode`` call, each with its own positions in the KV cache.

This module is the only one that touches ``llama_cpp``; the engine (``llamacpp_engine``) and teacher
forcing (``LlamaCppScorer``) build on it. The calls are llama.cpp's C API as llama-cpp-python 0.3.36
binds it (``include/llama.h`` of the llama.cpp it vendors): ``llama_model_load_from_file``,
``llama_init_from_model``, ``llama_batch_init`` / ``llama_decode`` / ``llama_get_logits`` (the logits
of the tokens whose ``logits`` flag is set, in batch order), the memory API that replaced
``llama_kv_cache_*`` (``llama_memory_seq_rm``, ``llama_memory_seq_pos_max``, ``llama_memory_clear``)
and LoRA adapters (``llama_adapter_lora_init``, ``llama_set_adapters_lora``).

The weights are the GGUF file's own tensors (quantized blocks as stored, memory-mapped): nothing is
de-quantized into a copy. llama.cpp's log goes to the ``gymserve.llamacpp`` logger (warnings and
errors at WARNING, the rest at DEBUG) instead of stderr.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gymserve.errors import EngineBuildError, EngineError

log = logging.getLogger("gymserve.llamacpp")

#: The portable llama.cpp build (``scripts/install_llamacpp.py`` passes the same flags, and a test
#: keeps the two equal): no ``-march=native``, x86-64-v3 (AVX2), no AVX-512, no AMX.
PORTABLE_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)
REBUILD_COMMAND = "python scripts/install_llamacpp.py"
REBUILD_HINT = (
    f"from a gymserve checkout run {REBUILD_COMMAND} (or make install) with the environment's python; "
    f'elsewhere: CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --no-cache-dir --force-reinstall --no-deps '
    '"llama-cpp-python>=0.3.36"'
)
INSTALL_HINT = (
    f"the llamacpp engine needs llama-cpp-python, which is not installed: from a gymserve checkout run "
    f"{REBUILD_COMMAND} (it builds llama.cpp from source for any x86-64 CPU with AVX2, about 10 minutes on 2 "
    "cores the first time; docs/getting-started.md, CPU requirements)"
)
#: Set to 1 to run a llama.cpp build with AMX kernels anyway (at the risk of ggml-org/llama.cpp#20824).
ALLOW_AMX_ENV = "GYMSERVE_LLAMACPP_ALLOW_AMX"
_FEATURE = re.compile(r"([A-Z][A-Z0-9_]*) = (\w+)")
GGUF_MAGIC = b"GGUF"
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type values of the KV cache types offered
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
_GGML_LOG_WARN = 3
_FLOAT_FILE_TYPES = {"0", "1", "32"}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16 (not quantized)

_lock = threading.Lock()
_ready = False
_log_callback: Any = None  # kept alive: llama.cpp holds the C pointer


# OpenMP threads that wait for work sleep instead of spinning (unless the user set a policy). llama.cpp
# runs its CPU threads in OpenMP parallel regions with a barrier after every operation; libgomp's
# default spins at those barriers, which on cores shared with other processes (CI runners, a laptop
# running a test suite) turns each barrier into a wait for a descheduled thread. Measured on 2 cores
# with a load average of 3-4 (the 0.5B GGUF, 2 threads, `OMP_WAIT_POLICY` default vs PASSIVE, two
# interleaved rounds): 30 decode steps 12.1 s / 16.2 s vs 2.9 s / 2.4 s, a 128-token prefill
# 7.0 s / 5.8 s vs 3.0 s / 3.3 s. Set before llama_cpp loads libgomp, which reads it once.
OMP_WAIT_POLICY = "PASSIVE"


def _quiet(msg: str) -> bool:
    """llama.cpp warnings about the model file that are not the user's to fix: logged at DEBUG.
    Qwen2.5's GGUF files name ``</s>`` a control token without its type, which llama.cpp repairs
    on every load ("control-looking token: ... was not control-type")."""
    return "control-looking token" in msg


def import_llama_cpp():
    """The ``llama_cpp`` module with its backend initialised once and its log routed to
    ``gymserve.llamacpp``; ``ImportError`` naming the install command when it is missing.
    Sets ``OMP_WAIT_POLICY`` (``PASSIVE``, see above) first unless the environment has one."""
    global _ready, _log_callback
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    with _lock:
        if not _ready:

            def _log(level: int, text: bytes, _user: Any) -> None:
                msg = text.decode("utf-8", "replace").rstrip("\n")
                if msg:
                    warn = level in (3, 4) and not _quiet(msg)
                    log.log(logging.WARNING if warn else logging.DEBUG, "%s", msg)

            _log_callback = llama_cpp.llama_log_callback(_log)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _ready = True
    check_build(llama_cpp.llama_print_system_info().decode("utf-8", "replace"))
    return llama_cpp


def system_features(info: str) -> dict[str, str]:
    """``{feature: value}`` from llama.cpp's ``llama_print_system_info()`` text, e.g.
    ``"CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | "`` → ``{"SSE3": "1", "AVX2": "1", "AMX_INT8": "1"}``."""
    return dict(_FEATURE.findall(info))


def check_build(info: str, environ: Any = None) -> None:
    """Refuse a llama.cpp whose ``llama_print_system_info()`` text ``info`` reports AMX kernels
    (``AMX_INT8 = 1``): pip's default build of llama-cpp-python compiles them in on a CPU that has
    AMX (``GGML_NATIVE``), and they crash in the first ``llama_decode`` (ggml-org/llama.cpp#20824,
    a segfault in ``ggml_backend_amx_mul_mat`` on Q4_K weights). Raises ``EngineBuildError`` naming
    the cause and the rebuild command, unless ``$GYMSERVE_LLAMACPP_ALLOW_AMX`` is ``1``
    (``environ``: ``os.environ`` unless given). A native build without AMX is not detectable from
    this text (llama.cpp reports features, not ``-march``) and runs on the machine that built it."""
    environ = os.environ if environ is None else environ
    amx = sorted(k for k, v in system_features(info).items() if k.startswith("AMX") and v == "1")
    if not amx or environ.get(ALLOW_AMX_ENV) == "1":
        return
    raise EngineBuildError(
        f"the installed llama-cpp-python was built with llama.cpp's AMX kernels ({', '.join(a + ' = 1' for a in amx)} "
        "in llama_print_system_info), which crash in the first llama_decode on current Xeons "
        "(ggml-org/llama.cpp#20824); pip's default build picks them on a CPU with AMX. Rebuild it without: "
        f"{REBUILD_HINT}. To run this build anyway, set {ALLOW_AMX_ENV}=1"
    )


def check_gguf(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path`` when it is a readable GGUF file (starts with the ``GGUF`` magic, as the
    GGUF spec defines); else ``EngineError`` naming the file and what to pass instead."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise EngineError(f"cannot read the GGUF file {p}: {exc.strerror or exc}; pass an existing .gguf file") from exc
    if magic != GGUF_MAGIC:
        raise EngineError(
            f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); the llamacpp engine runs GGUF "
            "weights: convert a Hugging Face model with llama.cpp's convert_hf_to_gguf.py"
        )
    return p


@dataclass(frozen=True)
class RuntimeOptions:
    """How the llama.cpp context is built (``llama_context_params``).

    ``n_seq_max``: sequences (KV cache rows) the context holds. ``n_ctx``: KV cells in all;
    ``kv_unified`` True: one pool shared by every sequence (a sequence may use up to ``n_ctx``),
    False: ``n_ctx / n_seq_max`` cells per sequence (llama-server's default with ``-np``).
    ``n_batch``: most tokens per ``llama_decode``; ``n_ubatch``: per compute step.
    ``n_threads`` / ``n_threads_batch``: decode / prefill threads (None: all cores).
    ``flash_attn``: ``off`` (the default: exact, see ``llamacpp_engine.ENGINE_ARGS``), ``on``, ``auto``. ``type_k``/``type_v``: KV cache type (``f16``,
    ``f32``, ``q8_0``). ``use_mmap``: map the GGUF file instead of reading it into memory.
    """

    n_ctx: int
    n_seq_max: int = 1
    kv_unified: bool = True
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | None = None
    n_threads_batch: int | None = None
    flash_attn: str = "off"
    type_k: str = "f16"
    type_v: str = "f16"
    use_mmap: bool = True


class LlamaModel:
    """One GGUF file loaded by llama.cpp (``llama_model``); read-only, shared by contexts.

    ``path``: the GGUF file. ``vocab_size``: rows of the output layer (``llama_vocab_n_tokens``);
    ``n_ctx_train``: the model's trained context; ``architecture``: ``general.architecture``;
    ``description``: llama.cpp's ``llama_model_desc`` (e.g. ``"qwen2 1.5B Q4_K - Medium"``);
    ``quantized``: whether the weights are quantized blocks (``general.file_type``, llama.cpp's
    ``llama_ftype``, is not F32, F16 or BF16; a file without it counts as quantized).
    Raises ``EngineError`` naming the file when llama.cpp cannot load it.
    """

    def __init__(self, path: str | os.PathLike, *, use_mmap: bool = True):
        self.lib = import_llama_cpp()
        self.path = check_gguf(path)
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mode = 1 if use_mmap else 0  # LLAMA_LOAD_MODE_MMAP / _NONE
        self.ptr = self.lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise EngineError(
                f"llama.cpp could not load {self.path} (see the gymserve.llamacpp log for its reason); "
                "check that the file is a complete GGUF model of an architecture this llama.cpp supports"
            )
        self.vocab = self.lib.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(self.lib.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(self.lib.llama_model_n_ctx_train(self.ptr))
        self.size_bytes = int(self.lib.llama_model_size(self.ptr))
        self.architecture = self.meta("general.architecture")
        buf = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.ptr, buf, len(buf))
        self.description = buf.value.decode("utf-8", "replace")
        file_type = self.meta("general.file_type")
        self.quantized = not (file_type is not None and file_type.strip() in _FLOAT_FILE_TYPES)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string (``llama_model_meta_val_str``), None when absent."""
        buf = ctypes.create_string_buffer(4096)
        n = self.lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def is_eog(self, token: int) -> bool:
        """Whether llama.cpp counts ``token`` as end of generation (``llama_vocab_is_eog``)."""
        return bool(self.lib.llama_vocab_is_eog(self.vocab, int(token)))

    def close(self) -> None:
        if self.ptr:
            self.lib.llama_model_free(self.ptr)
            self.ptr = None


class LlamaLora:
    """A LoRA adapter in llama.cpp's GGUF form (``general.type`` ``adapter``, ``adapter.type``
    ``lora``; what llama.cpp's convert_lora_to_gguf.py writes), loaded for ``model``. Raises
    ``EngineError`` naming the file when llama.cpp refuses it (wrong base model, bad tensors)."""

    def __init__(self, model: LlamaModel, path: str | os.PathLike):
        self.lib = model.lib
        self.path = check_gguf(path)
        self.ptr = self.lib.llama_adapter_lora_init(model.ptr, str(self.path).encode())
        if not self.ptr:
            raise EngineError(
                f"llama.cpp could not load the LoRA adapter {self.path} for {model.path} (see the "
                "gymserve.llamacpp log): it must be a GGUF LoRA adapter of this base model"
            )

    def close(self) -> None:
        if self.ptr:
            self.lib.llama_adapter_lora_free(self.ptr)
            self.ptr = None


class LlamaContext:
    """A llama.cpp context over ``model``: its KV cache and one reusable batch of ``n_batch`` tokens.

    Not thread-safe: one thread (the engine's worker) calls it. ``decode`` runs one
    ``llama_decode`` over tokens of any sequences and returns the logits asked for.
    """

    def __init__(self, model: LlamaModel, options: RuntimeOptions):
        self.lib = lib = model.lib
        self.model = model
        self.options = options
        for name in ("type_k", "type_v"):
            if getattr(options, name) not in KV_TYPES:
                raise ValueError(f"{name} must be one of {', '.join(KV_TYPES)}, got {getattr(options, name)!r}")
        if options.flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {options.flash_attn!r}")
        threads = options.n_threads or os.cpu_count() or 1
        p = lib.llama_context_default_params()
        p.n_ctx = int(options.n_ctx)
        p.n_batch = int(options.n_batch)
        p.n_ubatch = int(min(options.n_ubatch, options.n_batch))
        p.n_seq_max = int(options.n_seq_max)
        p.n_threads = int(threads)
        p.n_threads_batch = int(options.n_threads_batch or threads)
        p.flash_attn_type = FLASH_ATTN[options.flash_attn]
        p.type_k = KV_TYPES[options.type_k]
        p.type_v = KV_TYPES[options.type_v]
        p.kv_unified = bool(options.kv_unified)
        p.no_perf = True
        p.embeddings = False
        self.ptr = lib.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise EngineError(
                f"llama.cpp could not create a context of {options.n_ctx} KV cells for {model.path} (see the "
                "gymserve.llamacpp log); lower max_model_len or engine_args.kv_cells"
            )
        self.n_ctx = int(lib.llama_n_ctx(self.ptr))
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(self.ptr))
        self.n_batch = int(lib.llama_n_batch(self.ptr))
        self.mem = lib.llama_get_memory(self.ptr)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        n = self.n_batch
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(n,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n,))
        self._want = np.ctypeslib.as_array(self._batch.logits, shape=(n,))
        self._seq = [self._batch.seq_id[i] for i in range(n)]
        self.vocab_size = model.vocab_size

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], want: Sequence[bool]
    ) -> np.ndarray:
        """One ``llama_decode`` over ``len(tokens) <= n_batch`` tokens; token ``i`` goes to sequence
        ``seq_ids[i]`` at position ``positions[i]``. Returns the float32 logits ``[k, vocab]`` of the
        ``k`` tokens with ``want[i]`` set, in batch order (a copy). Raises ``KVCacheFull`` when
        llama.cpp finds no room in the KV cache (return code 1; nothing was added), ``EngineError``
        for any other failure."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"a batch holds 1 to {self.n_batch} tokens, got {n}")
        self._tok[:n] = tokens
        self._pos[:n] = positions
        self._nseq[:n] = 1
        self._want[:n] = want
        for i, s in enumerate(seq_ids):
            self._seq[i][0] = s
        self._batch.n_tokens = n
        rc = self.lib.llama_decode(self.ptr, self._batch)
        if rc == 1:
            raise KVCacheFull(f"no room for {n} tokens in the KV cache of {self.n_ctx} cells")
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} (see the gymserve.llamacpp log)")
        k = int(np.count_nonzero(self._want[:n]))
        if k == 0:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        ptr = self.lib.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(k, self.vocab_size)).copy()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Drop sequence ``seq_id``'s cells at positions ``[p0, p1)`` (``-1``: open end);
        ``seq_rm(s)`` drops the whole sequence."""
        if not self.lib.llama_memory_seq_rm(self.mem, seq_id, p0, p1):
            # Only a partial removal can fail (recurrent models); drop all of it instead.
            self.lib.llama_memory_seq_rm(self.mem, seq_id, -1, -1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make sequence ``dst`` hold ``src``'s cells at positions ``[p0, p1)`` too
        (``llama_memory_seq_cp``; in a unified pool the cells are shared, nothing is copied)."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int) -> int:
        """The largest position of ``seq_id`` in the cache, ``-1`` when it has none."""
        return int(self.lib.llama_memory_seq_pos_max(self.mem, seq_id))

    def clear(self) -> None:
        """Empty the whole KV cache."""
        self.lib.llama_memory_clear(self.mem, True)

    def set_lora(self, adapter: LlamaLora | None, scale: float = 1.0) -> None:
        """Serve with ``adapter`` (scale ``scale``) from the next decode on, or without any (None)."""
        if adapter is None:
            rc = self.lib.llama_set_adapters_lora(self.ptr, None, 0, None)
        else:
            arr = (self.lib.llama_adapter_lora_p_ctypes * 1)(adapter.ptr)
            scales = (ctypes.c_float * 1)(scale)
            rc = self.lib.llama_set_adapters_lora(self.ptr, arr, 1, scales)
        if rc != 0:
            raise EngineError(f"llama.cpp refused the LoRA adapter (llama_set_adapters_lora returned {rc})")

    def close(self) -> None:
        if self.ptr:
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.ptr)
            self.ptr = None


class KVCacheFull(Exception):
    """``llama_decode`` found no room in the KV cache for the batch (nothing was added); the engine
    frees cells and retries, so this never reaches a caller."""


def log_normalizer(logits: np.ndarray) -> np.ndarray:
    """``logsumexp`` over the last axis (``[..., vocab]`` float32 logits → ``[..., 1]`` float64):
    ``logits[..., t] - log_normalizer(logits)`` is token ``t``'s log-prob. The exponentials are
    float32 (the max is subtracted first, so none overflows) and summed in float64."""
    m = logits.max(axis=-1, keepdims=True)
    total = np.exp(logits - m).sum(axis=-1, keepdims=True, dtype=np.float64)
    return m.astype(np.float64) + np.log(total)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (a binary search over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class LlamaCppScorer:
    """Teacher forcing on llama.cpp: the log-prob of each token of a sequence given the tokens
    before it, from prefill passes over the whole sequence (``verify-rollouts --engine llamacpp``).

    ``gguf``: the GGUF file the rollouts were sampled from, or a loaded ``LlamaModel`` to share (a
    served engine's: ``LlamaCppEngine.teacher_forcer``; then the model, and ``adapter``, a loaded
    ``LlamaLora`` to apply, stay their owner's). ``lora``: a GGUF LoRA adapter file to load and
    apply. ``n_batch``: tokens per decode (logits for up to that many positions, ``n_batch × vocab
    × 4`` bytes, are kept at once). The context is sized to the longest sequence scored so far.
    Log-probs are ``log_softmax`` of the raw logits, as the engine reports them
    (``engine.base.Generation``).

    The KV cache of the last sequence scored is kept: the next one prefills only what follows
    their common prefix (rollouts of one task share their system prompt and tools), never a
    position whose logits are asked for. Those cells hold what a prefill pass over the same tokens
    computes, so the log-probs are teacher forcing's either way.
    """

    def __init__(
        self,
        gguf: str | os.PathLike | LlamaModel,
        *,
        n_batch: int = 512,
        n_threads: int | None = None,
        lora: str | os.PathLike | None = None,
        adapter: LlamaLora | None = None,
        **options: Any,
    ):
        self._owns_model = not isinstance(gguf, LlamaModel)
        self.model = LlamaModel(gguf) if not isinstance(gguf, LlamaModel) else gguf
        self.n_batch = n_batch
        self.n_threads = n_threads
        self.options = options
        self._owns_lora = lora is not None
        self.lora = LlamaLora(self.model, lora) if lora else adapter
        self._ctx: LlamaContext | None = None
        self._cached: list[int] = []  # the tokens whose KV sequence 0 holds

    @property
    def quantized(self) -> bool:
        """Whether the scored weights are quantized (``LlamaModel.quantized``)."""
        return self.model.quantized

    def _context(self, n: int) -> LlamaContext:
        if self._ctx is None or self._ctx.n_ctx < n:
            if self._ctx is not None:
                self._ctx.close()
            size = max(256, -(-n // 256) * 256)
            opts = RuntimeOptions(
                n_ctx=size, n_batch=self.n_batch, n_ubatch=self.n_batch, n_threads=self.n_threads, **self.options
            )
            self._ctx = LlamaContext(self.model, opts)
            self._cached = []
            if self.lora is not None:
                self._ctx.set_lora(self.lora)
        return self._ctx

    def token_log_probs(self, ids: Sequence[int], start: int) -> list[float]:
        """Log-probs of ``ids[start:]``, each given every token before it (``start >= 1``)."""
        if start < 1:
            raise ValueError("teacher forcing needs at least one prompt token")
        ids = [int(t) for t in ids]
        ctx = self._context(len(ids))
        keep = min(common_prefix(self._cached, ids), start - 1)
        ctx.seq_rm(0, keep, -1)
        self._cached = ids[:keep]
        out: list[float] = []
        for lo in range(keep, len(ids), ctx.n_batch):
            chunk = ids[lo : lo + ctx.n_batch]
            pos = list(range(lo, lo + len(chunk)))
            # Position p's logits predict ids[p + 1]: needed for p = start - 1 … len(ids) - 2.
            want = [start - 1 <= p < len(ids) - 1 for p in pos]
            logits = ctx.decode(chunk, pos, [0] * len(chunk), want)
            self._cached += chunk
            if len(logits):
                targets = [ids[p + 1] for p, w in zip(pos, want) if w]
                picked = logits[np.arange(len(targets)), targets].astype(np.float64)
                out += (picked - log_normalizer(logits)[:, 0]).tolist()
        return out

    def close(self) -> None:
        """Free the context, and the model and adapter when this scorer loaded them."""
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
        if self.lora is not None and self._owns_lora:
            self.lora.close()
        if self._owns_model:
            self.model.close()
