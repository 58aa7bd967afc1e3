"""Reading request outputs in vLLM's shape, which TensorRT-LLM's LLM API shares.

An output stream yields objects with ``finished`` and ``outputs[0]`` (a completion output with
``token_ids``, ``logprobs``, ``finish_reason``); log-probs come per position as a float (the sampled
token's) or as a mapping ``{token_id: Logprob(logprob, rank, ...)}`` (vLLM's ``SampleLogprobs``).
``output_deltas`` turns such a stream into gymserve's ``TokenDelta``s, failing loudly (``EngineError``)
rather than reporting a token without its log-prob. Both adapters ask for ``RAW_LOGPROBS``, and
``accepts`` tells which keyword arguments the installed library version takes.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from gymserve.engine.base import FinishReason, TokenDelta
from gymserve.errors import EngineError

RAW_LOGPROBS = "raw_logprobs"
"""The ``logprobs_mode`` of vLLM and TensorRT-LLM that reports the model's own distribution, before
temperature/top-k/top-p: the log-probs gymserve's contract promises (``engine.base.Generation``)."""


def map_finish_reason(reason: Any, engine: str, aborts: tuple[str, ...] = ()) -> FinishReason:
    """``"stop"`` / ``"length"`` as they are; a reason in ``aborts`` (the library's word for a
    request it aborted: vLLM's ``"abort"``, TensorRT-LLM's ``"cancelled"``) is ``"abort"`` — an
    aborted answer that keeps its tokens; anything else (a timeout, an unknown reason) is an error."""
    reason = str(reason) if reason is not None else None
    if reason in ("stop", "length"):
        return reason
    if reason in aborts:
        return "abort"
    raise EngineError(f"{engine} ended the generation with finish reason {reason!r} (aborted or failed)")


def accepts(cls: Any, name: str) -> bool:
    """Whether ``cls`` (a dataclass, msgspec struct or plain class) takes keyword ``name``."""
    if dataclasses.is_dataclass(cls):
        return name in {f.name for f in dataclasses.fields(cls)}
    if name in getattr(cls, "__struct_fields__", ()):
        return True
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _logprob(entry: Any) -> float:
    """A ``Logprob``'s value, or the entry itself when the library gives a bare float."""
    value: Any = getattr(entry, "logprob", entry)
    return float(value)


def position_logprob(position: Any, token: int, top_n: int, engine: str) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's log-prob and the top ``top_n`` alternatives from one position's log-probs:
    a float (the sampled token's), or a mapping ``{token_id: Logprob(logprob, rank, ...)}``."""
    if isinstance(position, (int, float)):
        return float(position), []
    if not isinstance(position, Mapping):
        raise EngineError(f"{engine} returned log-probs of an unknown form: {type(position).__name__}")
    entry: Any = position.get(token)
    if entry is None:
        raise EngineError(
            f"{engine} returned no log-prob for the sampled token {token}; gymserve needs the "
            "sampled token's log-prob at every position"
        )
    lp = _logprob(entry)
    tops: list[tuple[int, float]] = []
    if top_n > 0:
        items: list[tuple[int, float, Any]] = [
            (int(t), _logprob(e), getattr(e, "rank", None)) for t, e in position.items()
        ]
        ranked = [x for x in items if x[2] is not None and x[2] <= top_n]
        if ranked:
            ranked.sort(key=lambda x: x[2])
        else:  # no ranks given: the most likely top_n
            ranked = sorted(items, key=lambda x: -x[1])[:top_n]
        tops = [(t, v) for t, v, _ in ranked[:top_n]]
    return lp, tops


def parse_positions(token_ids: Sequence[int], logprobs: Any, top_n: int, engine: str):
    """``(ids, log_probs, top_logprobs)`` of tokens and their per-position log-probs (same length)."""
    ids = [int(t) for t in token_ids]
    if logprobs is None:
        if not ids:
            return [], [], []
        raise EngineError(f"{engine} returned no log-probs although they were requested")
    positions = list(logprobs)
    if len(positions) < len(ids):
        raise EngineError(f"{engine} returned {len(positions)} log-probs for {len(ids)} tokens")
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for tok, pos in zip(ids, positions):
        lp, alts = position_logprob(pos, tok, top_n, engine)
        lps.append(lp)
        tops.append(alts)
    return ids, lps, (tops if top_n > 0 else [])


Amend = Callable[[Any, list, list, list, "FinishReason | None"], tuple[list, list, list]]


async def output_deltas(
    outputs: AsyncIterator[Any],
    engine: str,
    top_n: int,
    *,
    cumulative: bool,
    amend: Amend | None = None,
    aborts: tuple[str, ...] = (),
) -> AsyncGenerator[TokenDelta, None]:
    """``TokenDelta``s from an engine's stream of request outputs in vLLM's shape (``out.finished``;
    ``out.outputs[0]`` with ``token_ids``, ``logprobs``, ``finish_reason``), which TensorRT-LLM's
    LLM API shares. ``cumulative``: each output repeats the earlier tokens, so only the new ones are
    kept. ``amend(completion_output, ids, log_probs, tops, finish)`` returns the three lists fixed up
    the way one engine needs; ``aborts``: see ``map_finish_reason``. Ends with the finished output; raises ``EngineError`` naming
    ``engine`` when the stream ends without one or the engine raises.
    """
    seen = 0
    try:
        async for out in outputs:
            comp = out.outputs[0]
            ids, lps, tops = parse_positions(comp.token_ids, comp.logprobs, top_n, engine)
            if cumulative:
                ids, lps, tops = ids[seen:], lps[seen:], tops[seen:]
                seen += len(ids)
            finish = map_finish_reason(comp.finish_reason, engine, aborts) if out.finished else None
            if amend is not None:
                ids, lps, tops = amend(comp, ids, lps, tops, finish)
            if ids or finish:
                yield TokenDelta(ids, lps, finish, tops)
            if out.finished:
                return
        raise EngineError(f"{engine} ended the request without a finished output")
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(f"{engine} generation failed: {type(exc).__name__}: {exc}") from exc
