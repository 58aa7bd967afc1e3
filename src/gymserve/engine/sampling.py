"""Choosing the next token from logits, and the log-probs reported for it.

The reported log-prob is that of the raw model distribution, ``log_softmax(logits)`` before
temperature, top-k and top-p, as vLLM reports by default (``logprobs_mode="raw_logprobs"``): it is
what a trainer recomputes by teacher forcing. Sampling itself follows vLLM's order: temperature,
then top-k, then top-p; ``temperature == 0`` is greedy (argmax) as in vLLM.
"""

from __future__ import annotations

import torch

from gymserve.engine.base import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded with ``params.seed`` (None when unseeded: the global RNG is used)."""
    if params.seed is None or params.temperature == 0:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(params.seed))
    return gen


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one token ID from ``logits`` (shape ``[vocab]``, float32) under ``params``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k is not None and 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
        drop = cum - torch.softmax(sorted_scores, dim=-1) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely ``(token_id, logprob)`` pairs of one position's raw log-probs."""
    if n <= 0:
        return []
    values, ids = torch.topk(logprobs, n)
    return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
