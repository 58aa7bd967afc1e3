"""Contract checks any ``Engine`` must pass, shared by the engines' tests (transformers, the vLLM and
TensorRT-LLM adapters, and engines to come): written once so every engine is held to the same rule."""

from __future__ import annotations

import asyncio

from gymserve.engine.base import SamplingParams


def assert_top_logprobs_leave_sampling_unchanged(
    engine, prompt_ids, *, max_tokens: int = 6, top_n: int = 3, log_prob_tol: float = 0.0
) -> None:
    """Asking for ``top_logprobs`` changes nothing of what is sampled: the same seeded call with
    and without alternatives samples the same tokens with the same log-probs (the trainer's
    numbers), and each position's alternatives are ``top_n`` pairs in descending order.
    ``log_prob_tol``: 0 (the same numbers) unless the engine's kernels round with the batch shape
    (llama.cpp: the two calls run side by side, one prefilling, one from the other's cached KV)."""
    base = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1234)
    with_top = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1234, top_logprobs=top_n)

    async def both():
        return await engine.generate(prompt_ids, base), await engine.generate(prompt_ids, with_top)

    plain, asked = asyncio.run(both())
    assert asked.token_ids == plain.token_ids
    if log_prob_tol == 0.0:
        assert asked.log_probs == plain.log_probs  # exactly: the same numbers, not merely close
    else:
        assert max(abs(a - b) for a, b in zip(asked.log_probs, plain.log_probs)) <= log_prob_tol
    assert plain.top_logprobs == [] or all(not t for t in plain.top_logprobs)
    assert len(asked.top_logprobs) == len(asked.token_ids)
    for tops in asked.top_logprobs:
        assert len(tops) == top_n
        assert [v for _, v in tops] == sorted((v for _, v in tops), reverse=True)
