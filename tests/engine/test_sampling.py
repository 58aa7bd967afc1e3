"""The samplers' filters (``engine.sampling`` on torch, ``engine.sampling_numpy`` on numpy) on hand-made
logits: min-p as vLLM's V1 sampler applies it (after temperature, before top-k and top-p), and both
samplers keep the same tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gymserve.engine import sampling, sampling_numpy
from gymserve.engine.base import SamplingParams

# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
LOGITS = [math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]


def _drawn(min_p: float, temperature: float = 1.0, draws: int = 400) -> tuple[set[int], set[int]]:
    """The tokens each sampler draws in ``draws`` seeded tries."""
    torch_seen, numpy_seen = set(), set()
    for seed in range(draws):
        params = SamplingParams(max_tokens=1, temperature=temperature, min_p=min_p, seed=seed)
        torch_seen.add(sampling.sample_next(torch.tensor(LOGITS), params, sampling.make_generator(params)))
        numpy_seen.add(sampling_numpy.sample_next(np.array(LOGITS), params, sampling_numpy.make_rng(params)))
    return torch_seen, numpy_seen


@pytest.mark.parametrize(
    "min_p, temperature, kept",
    [
        (0.0, 1.0, {0, 1, 2, 3}),  # off
        (0.25, 1.0, {0, 1, 2}),  # 0.05 < 0.25 * 0.5: dropped; 0.15 >= 0.125 stays
        (0.5, 1.0, {0, 1}),  # 0.15 < 0.25
        (1.0, 1.0, {0}),  # only the most likely: greedy
        (0.4, 0.5, {0}),  # temperature 0.5 first: 0.68, 0.25, 0.06, 0.01; only 0.68 is at least 0.4 * 0.68
        (0.4, 1.0, {0, 1}),  # the same min_p at temperature 1 keeps 0.3 too (>= 0.2)
    ],
)
def test_min_p_keeps_tokens_at_least_min_p_times_the_best(min_p, temperature, kept):
    torch_seen, numpy_seen = _drawn(min_p, temperature)
    assert torch_seen == kept and numpy_seen == kept
