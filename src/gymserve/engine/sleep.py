"""vLLM's sleep mode on gymserve's own engines: hand memory back between RL steps (colocated
training: the trainer and the server share a machine), and the cache and abort verbs beside it.

What each verb does on an engine whose worker thread owns the model (``engine.worker``: the
transformers and llamacpp engines); it runs on the worker between two decode steps:

===========================  ==================================================================
verb (vLLM's name)           effect
===========================  ==================================================================
``sleep(level=1)``           calls in flight end now (``finish_reason: abort``, their tokens kept),
                             their KV cache and every cached prefix are dropped; calls arriving
                             wait until ``wake_up``. The weights stay (on CPU they already are
                             where vLLM's level 1 offloads them to).
``sleep(level=2)``           level 1, and the weights are released: every state-dict tensor's
                             storage is freed (transformers engine only: llama.cpp's weights live in
                             its own model, so level 2 there is a 501).
``wake_up(tags)``            ``weights``: placeholders (zeros) of the released tensors' shapes and
                             dtypes come back, and calls stay held until an ``update_weights`` puts
                             values in them (vLLM's rule after level 2: reload the weights);
                             ``kv_cache``: calls are admitted again. No tags: both.
``reset_prefix_cache()``     drops the KV kept between calls (llamacpp's session cache; the
                             transformers engine keeps none, so nothing goes)
===========================  ==================================================================

Engines that run in a library of their own (vLLM, TensorRT-LLM) and engines without a worker
answer ``NotSupportedError`` (501) naming the engine.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from gymserve.engine.control import Command
from gymserve.errors import ConflictError, InvalidRequestError, NotSupportedError

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


def _worker(engine: Any, verb: str) -> Any:
    """``engine`` when it runs a gymserve worker (``_send``, ``_control``, ``_abort_running``), else 501."""
    if not all(hasattr(engine, a) for a in ("_send", "_control", "_abort_running", "_drop_cache")):
        name = getattr(engine, "engine_name", None) or type(engine).__name__
        raise NotSupportedError(
            f"{verb} is not available on the {name} engine: it runs in a library of its own (or has no "
            "cache or weights of its own); the transformers and llamacpp engines take it",
            code="sleep_not_supported",
        )
    return engine


def _release_weights(model: Any) -> list[tuple[Any, tuple[int, ...]]]:
    """Free every state-dict tensor's storage (tied tensors once); ``[(tensor, shape)]`` to restore."""
    import torch

    released = []
    seen: set[int] = set()
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if id(t) in seen:
                continue
            seen.add(id(t))
            released.append((t, tuple(t.shape)))
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return released


def _restore_placeholders(released: list[tuple[Any, tuple[int, ...]]]) -> None:
    import torch

    with torch.no_grad():
        for t, shape in released:
            t.data = torch.zeros(shape, dtype=t.dtype, device=t.device)


async def sleep(engine: Any, level: int = 1) -> dict[str, Any]:
    """Put ``engine`` to sleep at ``level`` (see module docstring); returns ``{"level",
    "aborted": calls ended, "cache_entries_dropped", "bytes_released"}``. Sleeping again at a
    deeper level goes deeper; at a shallower one it is a no-op. Raises ``InvalidRequestError``
    for a level other than 1 or 2, ``NotSupportedError`` (501) where the engine cannot."""
    if level not in SLEEP_LEVELS:
        raise InvalidRequestError(f"level must be 1 or 2 (vLLM's sleep levels), got {level!r}", param="level")
    eng = _worker(engine, "sleep")
    model = getattr(eng, "model", None)
    if level == 2 and not hasattr(model, "state_dict"):
        raise NotSupportedError(
            f"sleep level 2 (release the weights) is not available on the {getattr(eng, 'engine_name', type(eng).__name__)} "
            "engine: its weights live in the library's own model; level 1 drops its caches",
            code="sleep_not_supported",
        )

    def run() -> dict[str, Any]:
        ctl = eng._control
        aborted = len(eng._running())
        eng._abort_running()
        dropped = eng._drop_cache()
        released_bytes = 0
        if level == 2 and ctl.sleep_level < 2 and not ctl.weights_released:
            released = _release_weights(model)
            eng._released_weights = released
            released_bytes = sum(t.dtype.itemsize * _numel(shape) for t, shape in released)
        ctl.sleep_level = max(ctl.sleep_level, level)
        gc.collect()
        return {
            "level": ctl.sleep_level,
            "aborted": aborted,
            "cache_entries_dropped": dropped,
            "bytes_released": released_bytes,
        }

    out = await eng._send(Command("run", apply=run))
    _empty_device_cache()
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _empty_device_cache() -> None:
    """Hand freed CUDA blocks back to the driver (no-op on CPU)."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch-less engines
        pass


async def wake_up(engine: Any, tags: Sequence[str] | None = None) -> dict[str, Any]:
    """Wake ``engine`` (``tags``: vLLM's ``weights`` / ``kv_cache``, None for both); returns
    ``{"level": the sleep level left, "weights_released"}``. Raises ``InvalidRequestError`` for an
    unknown tag, ``ConflictError`` (409) for ``kv_cache`` alone while level-2 weights are gone."""
    wanted = tuple(WAKE_TAGS if not tags else tags)
    unknown = [t for t in wanted if t not in WAKE_TAGS]
    if unknown:
        raise InvalidRequestError(f"tags: unknown {unknown}; vLLM's tags are weights and kv_cache", param="tags")
    eng = _worker(engine, "wake_up")

    def run() -> dict[str, Any]:
        ctl = eng._control
        released = getattr(eng, "_released_weights", None)
        if "weights" in wanted and released:
            _restore_placeholders(released)
            eng._released_weights = None
            ctl.weights_released = True  # held until update_weights fills the placeholders
        if "kv_cache" in wanted:
            if getattr(eng, "_released_weights", None):
                raise ConflictError(
                    "the weights were released (sleep level 2): wake_up with tags weights first, then "
                    "update_weights, as vLLM's sleep mode requires",
                    code="weights_released",
                )
            ctl.sleep_level = 0
        elif ctl.sleep_level and not getattr(eng, "_released_weights", None):
            ctl.sleep_level = 1  # weights back; caches stay dropped until kv_cache wakes
        return {"level": ctl.sleep_level, "weights_released": ctl.weights_released}

    return await eng._send(Command("run", apply=run))


async def reset_prefix_cache(engine: Any) -> dict[str, Any]:
    """Drop the KV the engine keeps between calls; ``{"cache_entries_dropped": n}``."""
    eng = _worker(engine, "reset_prefix_cache")
    dropped = await eng._send(Command("run", apply=eng._drop_cache))
    return {"cache_entries_dropped": dropped}


def sleep_status(engine: Any) -> dict[str, Any] | None:
    """``{"is_sleeping", "level", "weights_released"}``, or None for an engine without sleep mode."""
    ctl = getattr(engine, "_control", None)
    if ctl is None or not hasattr(engine, "_drop_cache"):
        return None
    return {"is_sleeping": ctl.sleep_level > 0, "level": ctl.sleep_level, "weights_released": ctl.weights_released}
