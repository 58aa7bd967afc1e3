"""POST /v1/completions over the chat backend (``return_token_id_information``), forwarded to a real
upstream (another gymserve on the tiny model) and driven by the official openai SDK: the training
fields arrive on every choice, whole and streamed, and equal what the upstream sampled."""

from __future__ import annotations

import openai
import pytest

from helpers.fakes import FakeServer
from helpers.fields import assert_same_call
from helpers.servers import gateway


def gateway_to(backend):
    return gateway({"type": "chat", **backend})


FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _fields(choice):
    return tuple(choice.model_extra.get(f) for f in FIELDS)


def test_forwarded_completion_carries_the_upstreams_tokens(tiny_gateway_client, tiny_local_client):
    gateway, upstream = tiny_gateway_client, tiny_local_client
    kwargs = dict(model="t", prompt=[[9707, 11], [16, 17]], max_tokens=4, n=2)
    through, direct = gateway.completions.create(**kwargs), upstream.completions.create(**kwargs)
    assert [c.text for c in through.choices] == [c.text for c in direct.choices]
    for mine, theirs in zip(through.choices, direct.choices, strict=True):
        assert_same_call(_fields(mine), _fields(theirs))
    assert all(c.logprobs is None for c in through.choices)  # asked for by gymserve, not by the client


def test_forwarded_stream_puts_the_fields_on_each_finish_chunk(tiny_gateway_client, tiny_local_client):
    gateway, upstream = tiny_gateway_client, tiny_local_client
    direct = upstream.completions.create(model="t", prompt="Hello", max_tokens=5, n=2)
    chunks = list(gateway.completions.create(model="t", prompt="Hello", max_tokens=5, n=2, stream=True))
    finals = {c.choices[0].index: c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason}
    assert sorted(finals) == [0, 1]
    for choice in direct.choices:
        assert_same_call(_fields(finals[choice.index]), _fields(choice))


def test_vllm_token_metadata_becomes_training_fields():
    """A vLLM-shaped upstream (``prompt_token_ids`` and ``token_ids`` on the choice, ``token_id:N``
    log-prob tokens, the prompt's tokens first with ``echo``): the fields are read from it, and the
    request gymserve sends asks vLLM for them."""
    seen = []

    def vllm(r):
        if r.method == "GET":  # the replica health probe
            return 200, {"object": "list", "data": [{"id": "m", "object": "model"}]}
        assert r.path == "/v1/completions"
        seen.append(r.body)
        prompt = [5, 6]
        toks = ([f"token_id:{t}" for t in prompt] if r.body.get("echo") else []) + ["token_id:7", "token_id:8"]
        lps = ([None, -0.5] if r.body.get("echo") else []) + [-0.25, -0.75]
        choice = {
            "index": 0,
            "text": " x y",
            "finish_reason": "length",
            "logprobs": {"tokens": toks, "token_logprobs": lps, "top_logprobs": None, "text_offset": []},
            "prompt_token_ids": prompt,
            "token_ids": [7, 8],
        }
        return 200, {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}

    with (
        FakeServer(vllm) as fake,
        gateway_to({"base_urls": [fake.url + "/v1"], "return_token_id_information": True}) as srv,
    ):
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        for echo in (False, True):
            choice = client.completions.create(model="m", prompt="a b", max_tokens=2, echo=echo).choices[0]
            assert _fields(choice) == ([5, 6], [7, 8], [-0.25, -0.75])
    assert seen[0]["return_token_ids"] is True and seen[0]["logprobs"] == 0
    assert seen[0]["return_tokens_as_token_ids"] is True


def test_upstream_without_completions_is_a_502_that_says_so():
    with (
        FakeServer(lambda r: (404, {"detail": "Not Found"})) as fake,
        gateway_to({"base_urls": [fake.url + "/v1"], "max_retries": 0}) as srv,
    ):
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model="m", prompt="a", max_tokens=2)
    assert exc.value.status_code == 502 and "/v1/chat/completions" in exc.value.body["message"]
