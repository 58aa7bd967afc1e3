"""POST /v1/completions on the local engine, driven by the official openai SDK (tiny model): text and
token-ID prompts, n choices with seed + j, legacy log-probs, echo, streaming, the training fields on
every choice, and a multi-turn rollout given as token IDs staying contiguous."""

from __future__ import annotations

import httpx
import pytest

from helpers.fields import assert_same_call

FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@pytest.fixture(scope="module")
def client(tiny_local_client):
    return tiny_local_client


def _fields(choice):
    return tuple(choice.model_extra[f] for f in FIELDS)


def test_text_prompt_is_tokenized_as_vllm_does(client, tokenizer):
    r = client.completions.create(model="t", prompt="def add(a, b):", max_tokens=5)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    [choice] = r.choices
    p, g, lp = _fields(choice)
    assert p == tokenizer("def add(a, b):", add_special_tokens=True)["input_ids"]
    assert len(g) == len(lp) == 5 and choice.finish_reason == "length"
    assert choice.text == tokenizer.decode(g)
    assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 5


def test_token_id_prompts_reach_the_engine_unchanged(client):
    prompts = [[9707, 11, 1879], [16, 17, 18, 19]]
    r = client.completions.create(model="t", prompt=prompts, max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [_fields(c)[0] for c in r.choices] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 12


def test_choices_sample_with_seed_plus_j_reproducibly(client):
    """Choice j samples with seed + j (vLLM's rule): the choices differ from one another, and choice
    j equals the single-choice call made with seed + j."""
    prompt = [9707, 11, 1879]
    many = client.completions.create(model="t", prompt=prompt, max_tokens=6, n=3)
    gens = [_fields(c)[1] for c in many.choices]
    assert len({tuple(g) for g in gens}) == 3
    again = client.completions.create(model="t", prompt=prompt, max_tokens=6, n=3)
    assert [_fields(c)[1] for c in again.choices] == gens
    assert _fields(client.completions.create(model="t", prompt=prompt, max_tokens=6).choices[0])[1] == gens[0]


def test_legacy_logprobs_and_alternatives_leave_the_sampled_ones_unchanged(client):
    prompt = [9707, 11, 1879]
    plain = client.completions.create(model="t", prompt=prompt, max_tokens=4).choices[0]
    asked = client.completions.create(model="t", prompt=prompt, max_tokens=4, logprobs=3).choices[0]
    assert _fields(asked) == _fields(plain)  # same tokens, same log-probs: asking changes nothing
    lp = asked.logprobs
    assert lp.token_logprobs == _fields(asked)[2]
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob)  # the sampled token is always listed
        assert 3 <= len(top) <= 4
    assert lp.text_offset[0] == 0


def test_tokens_as_ids(client):
    r = client.completions.create(
        model="t", prompt=[9707], max_tokens=3, logprobs=0, extra_body={"return_tokens_as_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in _fields(choice)[1]]


def test_echo_puts_the_prompt_text_first(client, tokenizer):
    r = client.completions.create(model="t", prompt="Once upon a time", max_tokens=3, echo=True)
    choice = r.choices[0]
    assert choice.text == "Once upon a time" + tokenizer.decode(_fields(choice)[1])


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from gymserve.harness.verify import load_model

    return load_model(tiny_model_dir)


def test_echo_with_logprobs_scores_the_prompt_by_teacher_forcing(client, tokenizer, tiny_model):
    """vLLM's shape: the prompt's tokens first (the first one's log-prob and alternatives null),
    then the generated ones; the prompt's log-probs are those of a teacher-forced forward pass."""
    from gymserve.harness.verify import teacher_forced_log_probs

    prompt = "Once upon a time there"
    r = client.completions.create(model="t", prompt=prompt, max_tokens=3, echo=True, logprobs=2)
    choice = r.choices[0]
    p, g, glp = _fields(choice)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(p) + 3
    assert lp.tokens == [tokenizer.decode([t]) for t in p + g]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    recomputed = teacher_forced_log_probs(tiny_model, p[:1], p[1:])
    assert lp.token_logprobs[1 : len(p)] == pytest.approx(recomputed, abs=1e-4)
    assert lp.token_logprobs[len(p) :] == glp  # the generated ones as generation_log_probs
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == pytest.approx(logprob) and 2 <= len(top) <= 3
        assert max(top.values()) >= logprob
    assert lp.text_offset[: len(p)] == [len(tokenizer.decode(p[:i])) for i in range(len(p))]
    assert lp.text_offset[len(p)] == len(prompt) and choice.text.startswith(prompt)
    # vLLM's prompt_logprobs field comes with it: null, then {id: {logprob, rank, decoded_token}}.
    scores = choice.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(p)
    for i in range(1, len(p)):
        mine = scores[i][str(p[i])]
        assert mine["logprob"] == lp.token_logprobs[i] and mine["decoded_token"] == lp.tokens[i]
        better = [e for e in scores[i].values() if e["logprob"] > mine["logprob"]]
        # Listed with the top 2: its rank is its place among them; else it ranks below them.
        assert mine["rank"] == 1 + len(better) if len(scores[i]) == 2 else mine["rank"] > 2 == len(better)
        others = sorted((e for t, e in scores[i].items() if t != str(p[i])), key=lambda e: e["rank"])
        assert [e["logprob"] for e in others] == sorted((e["logprob"] for e in others), reverse=True)


def test_prompt_logprobs_field_without_echo(client, tiny_model):
    from gymserve.harness.verify import teacher_forced_log_probs

    prompt = [9707, 11, 1879, 0, 16]
    r = client.completions.create(model="t", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 0})
    choice = r.choices[0]
    assert choice.logprobs is None
    scores = choice.model_extra["prompt_logprobs"]
    assert scores[0] is None and [list(s) for s in scores[1:]] == [[str(t)] for t in prompt[1:]]
    recomputed = teacher_forced_log_probs(tiny_model, prompt[:1], prompt[1:])
    assert [s[str(t)]["logprob"] for s, t in zip(scores[1:], prompt[1:])] == pytest.approx(recomputed, abs=1e-4)
    # Asking for them changes nothing sampled.
    plain = client.completions.create(model="t", prompt=prompt, max_tokens=2).choices[0]
    assert_same_call(_fields(plain), _fields(choice))
    assert "prompt_logprobs" not in plain.model_extra


def test_echo_logprobs_stream_equals_the_whole_answer(client):
    kwargs = dict(model="t", prompt=["Hello there", "Once upon"], max_tokens=4, echo=True, logprobs=2)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        [final] = [c for c in mine if c.finish_reason]
        assert final.logprobs.model_dump() == choice.logprobs.model_dump()
        assert final.model_extra["prompt_logprobs"] == choice.model_extra["prompt_logprobs"]
        assert_same_call(_fields(final), _fields(choice))


def test_an_engine_without_prompt_logprobs_answers_501_naming_it(tiny_local_server, monkeypatch):
    monkeypatch.setattr(tiny_local_server.backend.engine, "supports_prompt_logprobs", False)
    for extra in ({"echo": True, "logprobs": 1}, {"prompt_logprobs": 0}):
        body = {"model": "t", "prompt": "a b", "max_tokens": 1, **extra}
        r = httpx.post(tiny_local_server.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 501, r.text
        err = r.json()["error"]
        assert err["code"] == "prompt_logprobs_not_supported" and "the transformers engine does not" in err["message"]
    body = {"model": "t", "prompt": "a b", "max_tokens": 1, "echo": True}  # echo alone needs no scores
    assert httpx.post(tiny_local_server.base_url + "/completions", json=body, timeout=60).status_code == 200


def test_stream_equals_the_whole_answer(client):
    kwargs = dict(model="t", prompt=[9707, 11], max_tokens=6, n=2)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        [final] = [c for c in mine if c.finish_reason]
        assert final.finish_reason == choice.finish_reason
        assert_same_call(_fields(final), _fields(choice))
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12


def test_a_rollout_given_as_token_ids_stays_contiguous(client):
    """Turn k+1's prompt is turn k's prompt + generation + new tokens, built by the client from the
    IDs it got back: the prompt the engine saw is exactly what was sent, turn after turn."""
    prompt = [9707, 11, 1879, 0]
    for _ in range(3):
        choice = client.completions.create(model="t", prompt=prompt, max_tokens=4).choices[0]
        p, g, _ = _fields(choice)
        assert p == prompt
        prompt = p + g + [198, 9707]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "a", "suffix": "b"}, "suffix", "insert mode"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs", "out of range"),
        ({"prompt": "a", "guided_grammar": "root ::= 'a'"}, "guided_grammar", "not applied"),
        ({"prompt": "a", "min_p": 2}, "min_p", "out of range"),  # applied per request, so checked
        ({"prompt": [[1], [151936]]}, "prompt[1][0]", "outside the model's vocabulary"),
        ({"prompt": [5, -1]}, "prompt[1]", "non-negative"),
        ({"prompt": ""}, "prompt", "is empty"),
        ({"prompt": "word " * 600}, None, "context length"),
        ({"prompt": "a", "frequency_penalty": 1}, "frequency_penalty", "not applied"),
    ],
)
def test_refused_requests_are_400s_naming_the_field(tiny_local_server, body, param, words):
    r = httpx.post(tiny_local_server.base_url + "/completions", json={"model": "t", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"]
    if param:
        assert err["param"] == param
