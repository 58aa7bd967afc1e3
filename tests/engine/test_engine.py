"""The in-process CPU engines (transformers, llamacpp), each on the tiny model: exact log-probs under
continuous batching, seeds, limits, cancellation. Teacher forcing runs on the engine's own kernels
(the transformers model, or llama.cpp's prefill through ``LlamaCppScorer``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from gymserve.engine.base import SamplingParams
from gymserve.harness.verify import load_model, teacher_forced_log_probs


@pytest.fixture(scope="module")
def engine(local_engine):
    name, model = local_engine
    if name == "llamacpp":
        from gymserve.engine.llamacpp_engine import LlamaCppEngine

        eng = LlamaCppEngine(model / "model.gguf", tokenizer_dir=model, max_batch_size=4, num_threads=2)
    else:
        from gymserve.engine.transformers_engine import TransformersEngine

        eng = TransformersEngine(model, max_batch_size=4, num_threads=2)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def scorer(engine, local_engine):
    """Teacher forcing on the engine's own kernels, as ``verify-rollouts --engine`` loads it."""
    name, model = local_engine
    return load_model(model, name) if name == "llamacpp" else engine.model


def test_model_type_is_the_configs(engine, tiny_model_dir):
    """``Engine.model_type`` is config.json's ``model_type`` (the GGUF's ``general.architecture`` for
    llamacpp); tool-call parser inference reads it."""
    assert json.loads((tiny_model_dir / "config.json").read_text())["model_type"] == "qwen2"
    assert engine.model_type == "qwen2"


def _prompts():
    # Different lengths force left-padding when they share a batch.
    return [list(range(1000, 1000 + n)) for n in (5, 17, 9, 30, 3, 12)]


def test_concurrent_log_probs_match_teacher_forcing(engine, scorer):
    async def run():
        sp = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
        return await asyncio.gather(*[engine.generate(p, sp) for p in _prompts()])

    gens = asyncio.run(run())
    worst = 0.0
    for prompt, gen in zip(_prompts(), gens):
        assert len(gen.token_ids) == len(gen.log_probs) == 10
        assert gen.finish_reason == "length"
        tf = teacher_forced_log_probs(scorer, prompt, gen.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(tf, gen.log_probs)))
    assert worst <= 1e-4


def test_batched_equals_alone_greedy(engine):
    sp = SamplingParams(max_tokens=8, temperature=0)

    async def run():
        together = await asyncio.gather(*[engine.generate(p, sp) for p in _prompts()])
        alone = [await engine.generate(p, sp) for p in _prompts()]
        return together, alone

    together, alone = asyncio.run(run())
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_seed_reproducible_and_distinct(engine):
    p = _prompts()[1]

    async def run(seed):
        return (await engine.generate(p, SamplingParams(max_tokens=12, temperature=1.0, seed=seed))).token_ids

    a, b, c = asyncio.run(run(11)), asyncio.run(run(11)), asyncio.run(run(12))
    assert a == b
    assert a != c


def test_stop_token_ends_generation(engine):
    p = _prompts()[2]
    greedy = asyncio.run(engine.generate(p, SamplingParams(max_tokens=6, temperature=0))).token_ids
    stop = greedy[2]
    first = greedy.index(stop)
    gen = asyncio.run(engine.generate(p, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(stop,))))
    assert gen.finish_reason == "stop"
    assert gen.token_ids == greedy[: first + 1]


def test_top_logprobs_include_sampled_when_greedy(engine):
    gen = asyncio.run(engine.generate(_prompts()[0], SamplingParams(max_tokens=3, temperature=0, top_logprobs=3)))
    assert len(gen.top_logprobs) == 3
    for tok, lp, tops in zip(gen.token_ids, gen.log_probs, gen.top_logprobs):
        assert tops[0][0] == tok and abs(tops[0][1] - lp) < 1e-6
        assert [x[1] for x in tops] == sorted((x[1] for x in tops), reverse=True)


def test_top_logprobs_leave_the_sampled_tokens_and_log_probs_unchanged(engine):
    from helpers.engine_contract import assert_top_logprobs_leave_sampling_unchanged

    # llama.cpp rounds the same call's logits ~1e-8 differently with the batch shape (see
    # tests/backends/test_stream_local.py); the other engines give the same numbers.
    tol = 1e-6 if engine.engine_name == "llamacpp" else 0.0
    assert_top_logprobs_leave_sampling_unchanged(engine, _prompts()[1], log_prob_tol=tol)


def test_cancel_frees_the_slot(engine):
    async def run():
        sp = SamplingParams(max_tokens=2000, temperature=0)
        stream = engine.stream(_prompts()[3], sp)
        got = 0
        async for _ in stream:
            got += 1
            if got == 2:
                break
        await stream.aclose()
        # The engine keeps serving: a new request completes promptly.
        return await asyncio.wait_for(engine.generate(_prompts()[0], SamplingParams(max_tokens=2, temperature=0)), 60)

    gen = asyncio.run(run())
    assert len(gen.token_ids) == 2


def test_logprobs_are_raw_distribution_not_tempered(engine, scorer):
    """Reported log-probs are log_softmax of the raw logits whatever the temperature (vLLM's default)."""
    p = _prompts()[4]
    gen = asyncio.run(engine.generate(p, SamplingParams(max_tokens=4, temperature=0.5, seed=1)))
    raw = teacher_forced_log_probs(scorer, p, gen.token_ids)
    for j in range(len(gen.token_ids)):
        assert abs(raw[j] - gen.log_probs[j]) < 1e-4


def test_min_p_one_is_greedy_and_log_probs_stay_raw(engine, scorer):
    """min_p 1 keeps only the most likely token (vLLM's rule: p >= min_p * p_max), so it samples as
    greedy does at any temperature; the reported log-probs stay the raw model's."""
    p = _prompts()[2]
    greedy = asyncio.run(engine.generate(p, SamplingParams(max_tokens=5, temperature=0)))
    cut = asyncio.run(engine.generate(p, SamplingParams(max_tokens=5, temperature=1.5, min_p=1.0, seed=3)))
    assert cut.token_ids == greedy.token_ids
    raw = teacher_forced_log_probs(scorer, p, cut.token_ids)
    assert max(abs(a - b) for a, b in zip(raw, cut.log_probs)) < 1e-4
