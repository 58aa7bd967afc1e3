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
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo", "prompt's tokens"),
        ({"prompt": "a", "stop": ["\n"]}, "stop", "stop is not supported"),
        ({"prompt": "a", "temperature": 0.2}, "temperature", "pinned"),
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
