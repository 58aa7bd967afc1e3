"""``engine.sampling``'s rules on numpy arrays, for engines that run without torch (llama.cpp).

The same order and cut-offs as ``engine.sampling`` (vLLM's): temperature, then min-p (tokens less
likely than ``min_p`` times the most likely one are dropped), then top-k, then top-p (the smallest
set of most likely tokens whose mass reaches ``top_p``, always at least one);
``temperature == 0`` is greedy (argmax). Reported log-probs are the raw distribution's
(``logits - llamacpp_runtime.log_normalizer(logits)``, before temperature/min-p/top-k/top-p), never these
filtered ones. A seed gives a ``numpy.random.Generator`` (PCG64) of its own, so a seeded request
samples the same tokens whatever runs beside it; the draws differ from the torch engine's, whose
generator is torch's.
"""

from __future__ import annotations

import numpy as np

from gymserve.engine.base import SamplingParams

_default_rng = np.random.default_rng()


def make_rng(params: SamplingParams) -> np.random.Generator | None:
    """A generator seeded with ``params.seed`` (None when unseeded or greedy)."""
    if params.seed is None or params.temperature == 0:
        return None
    return np.random.Generator(np.random.PCG64(int(params.seed)))


def _top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest most-likely set whose mass reaches ``top_p``. Looks at the
    ``m`` largest probabilities first (m = 64, 512, ...) instead of sorting the whole vocabulary."""
    m = 64
    while True:
        m = min(m, probs.size)
        part = np.argpartition(-probs, m - 1)[:m] if m < probs.size else np.arange(probs.size)
        order = part[np.argsort(-probs[part], kind="stable")]
        cum = np.cumsum(probs[order])
        if cum[-1] >= top_p or m == probs.size:
            # Keep a token while the mass before it is below top_p (engine.sampling's rule).
            before = cum - probs[order]
            return order[before < top_p]
        m *= 8


def sample_next(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Sample one token ID from ``logits`` (``[vocab]`` float32) under ``params``."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scores = logits.astype(np.float64) / params.temperature
    if params.min_p > 0:
        # p_i >= min_p * p_max  <=>  s_i >= s_max + log(min_p): no softmax needed for the cut.
        scores[scores < scores.max() + np.log(params.min_p)] = -np.inf
    if params.top_k is not None and 0 < params.top_k < scores.size:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores[scores < kth] = -np.inf
    scores -= scores.max()
    probs = np.exp(scores)
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = _top_p_keep(probs, params.top_p)
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    cdf = np.cumsum(probs)
    u = (rng or _default_rng).random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.size - 1))


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely ``(token_id, logprob)`` pairs of one position's raw log-probs, best first."""
    if n <= 0:
        return []
    n = min(n, logprobs.size)
    part = np.argpartition(-logprobs, n - 1)[:n]
    order = part[np.argsort(-logprobs[part], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in order]
