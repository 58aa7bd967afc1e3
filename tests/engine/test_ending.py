"""``engine.ending``: the one rule of when a generation ends (EOS, stop tokens, ``min_tokens``,
``ignore_eos``, length, stop strings), on its own and inside each in-process CPU engine.

The tiny model rarely samples its real EOS, so the engine tests make the greedy first token the
"EOS" (``engine.eos_token_ids``, which every call reads): then the model's own EOS ends a greedy
generation at once, and ``ignore_eos``/``min_tokens`` visibly change that.
"""

from __future__ import annotations

import asyncio

import pytest

from gymserve.engine.base import SamplingParams
from gymserve.engine.ending import Ending, StopStrings, cut_at_hit, cut_at_stop, stop_reason


def test_the_stop_set_is_eos_and_stop_tokens_and_ignore_eos_drops_the_eos():
    sp = SamplingParams(max_tokens=4, stop_token_ids=(7,))
    assert Ending.of((1, 2), sp).stop_ids == {1, 2, 7}
    assert Ending.of((1, 2), SamplingParams(max_tokens=4, stop_token_ids=(7,), ignore_eos=True)).stop_ids == {7}


def test_min_tokens_masks_the_stop_set_until_reached_and_finish_follows_the_rule():
    rule = Ending.of((1,), SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=(9,)))
    assert rule.suppressed(0) == [1, 9] and rule.suppressed(1) == [1, 9] and rule.suppressed(2) == []
    assert rule.finish(9, 2) == "stop" and rule.finish(5, 2) is None and rule.finish(5, 3) == "length"


def test_stop_reason_is_a_request_stop_token_and_none_for_eos():
    sp = SamplingParams(max_tokens=4, stop_token_ids=(7,))
    assert stop_reason([3, 7], "stop", sp, (1,)) == 7
    assert stop_reason([3, 1], "stop", sp, (1,)) is None
    assert stop_reason([3, 7], "length", sp, (1,)) is None


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_string():
    watch = StopStrings(["END"])
    shown = watch.feed("abcE") + watch.feed("N")
    assert shown == "abc" and watch.hit is None  # "EN" may begin END: held back
    assert watch.feed("Dxyz") == "" and watch.hit == "END"
    assert watch.flush() == ""
    watch = StopStrings(["END"])
    assert watch.feed("abcEN") + watch.feed("o") + watch.flush() == "abcENo"
    assert StopStrings(["END"], include=True).feed("xENDy") == "xEND"


def test_stop_strings_are_not_checked_before_min_tokens():
    watch = StopStrings(["ab"])
    assert watch.feed("ab", armed=False) == "ab" and watch.hit is None
    assert watch.feed("cab") == "c" and watch.hit == "ab"


def test_cut_helpers():
    assert cut_at_stop("hello world", ["o w", "ld"]) == ("hell", "o w")
    assert cut_at_stop("hello", ["x"]) == ("hello", None)
    assert cut_at_hit("a-b-c", "-") == "a-b" and cut_at_hit("a-b-c", "-", include=True) == "a-b-"


# ---------------------------------------------------------------- inside the engines


@pytest.fixture(scope="module")
def engine(local_engine):
    name, model = local_engine
    if name == "llamacpp":
        from gymserve.engine.llamacpp_engine import LlamaCppEngine

        eng = LlamaCppEngine(model / "model.gguf", tokenizer_dir=model, max_batch_size=2, num_threads=2)
    else:
        from gymserve.engine.transformers_engine import TransformersEngine

        eng = TransformersEngine(model, max_batch_size=2, num_threads=2)
    real_eos = eng.eos_token_ids
    yield eng
    eng.eos_token_ids = real_eos
    asyncio.run(eng.close())


PROMPT = [9707, 11, 1879, 0, 1446]


def _gen(engine, **kw):
    return asyncio.run(engine.generate(PROMPT, SamplingParams(temperature=0, **kw)))


def test_engines_end_on_eos_keep_it_and_ignore_eos_runs_past_it(engine):
    base = _gen(engine, max_tokens=6)
    first = base.token_ids[0]
    real = engine.eos_token_ids
    engine.eos_token_ids = (first,)
    try:
        ended = _gen(engine, max_tokens=6)
        assert ended.token_ids == [first] and ended.finish_reason == "stop"
        assert ended.log_probs == pytest.approx(base.log_probs[:1], abs=1e-5)
        ignored = _gen(engine, max_tokens=6, ignore_eos=True)
        assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    finally:
        engine.eos_token_ids = real


def test_engines_apply_min_tokens_and_report_raw_log_probs(engine):
    base = _gen(engine, max_tokens=6, top_logprobs=5)
    first = base.token_ids[0]
    held = _gen(engine, max_tokens=6, stop_token_ids=(first,), min_tokens=3, top_logprobs=5)
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    # The first token is the runner-up of the unmasked distribution; its log-prob is the raw one.
    runner_up = base.top_logprobs[0][1]
    assert held.token_ids[0] == runner_up[0]
    assert held.log_probs[0] == pytest.approx(runner_up[1], abs=1e-5)
    stopped = _gen(engine, max_tokens=6, stop_token_ids=(first,))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
