"""Choosing the next token from logits, and the log-probs reported for it.

The reported log-prob is that of the raw model distribution, ``log_softmax(logits)`` before
temperature, min-p, top-k and top-p, as vLLM reports by default (``logprobs_mode="raw_logprobs"``):
it is what a trainer recomputes by teacher forcing. Sampling itself follows vLLM's V1 sampler's
order (``vllm/v1/sample/sampler.py``): temperature, then min-p (a token stays when its probability
is at least ``min_p`` times the most likely one's), then top-k, then top-p; ``temperature == 0`` is
greedy (argmax) as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gymserve.engine.base import PromptLogprobs, SamplingParams

PROMPT_ROWS = 256
"""Prompt positions turned into log-probs at a time: bounds the extra memory to ``256 × vocab``
floats however long the prompt (the logits themselves are the forward pass's)."""


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
    if params.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int], k: int) -> PromptLogprobs:
    """The log-probs of ``prompt_ids`` from the logits of one forward pass over them.

    ``logits``: ``[P, vocab]``, row ``i`` predicting token ``i + 1`` (a causal LM's output over the
    prompt, teacher forcing); ``k``: alternatives per position. Each row's raw ``log_softmax`` in
    float32 (as ``Generation.log_probs``); ranks count the tokens at least as likely (vLLM's
    ``batched_count_greater_than``, so rank 1 is the most likely). Position 0 has none (``None``)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=logits.device)
    out = PromptLogprobs(log_probs=[None], ranks=[None], top_logprobs=[[]])
    for start in range(0, len(ids) - 1, PROMPT_ROWS):
        end = min(start + PROMPT_ROWS, len(ids) - 1)
        logp = torch.log_softmax(logits[start:end].float(), dim=-1)
        token = logp.gather(-1, ids[start + 1 : end + 1].unsqueeze(-1))
        out.log_probs += token.squeeze(-1).tolist()
        out.ranks += (logp >= token).sum(-1).tolist()
        if k > 0:
            values, top = torch.topk(logp, k, dim=-1)
            out.top_logprobs += [list(zip(i, v)) for i, v in zip(top.tolist(), values.tolist())]
        else:
            out.top_logprobs += [[] for _ in range(end - start)]
    return out
