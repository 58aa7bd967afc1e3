"""Token fields over the chat backend (``token_stream``): n > 1 choices each get theirs, whole and
streamed, and required_prefix_token_ids is forwarded and checked against the prompt the upstream
reports. The upstream is a real server (another gymserve on the tiny model) or, to show an upstream
that ignores the prefix, a vLLM-shaped fake."""

from __future__ import annotations

import openai
import pytest

from helpers.fakes import FakeServer, completion
from helpers.fields import assert_same_call
from helpers.servers import gateway

FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
HELLO = [{"role": "user", "content": "Say something."}]


def _fields(obj):
    return tuple(obj.model_extra.get(f) for f in FIELDS)


def test_each_choice_gets_its_fields(tiny_gateway_client, tiny_local_client):
    gateway, upstream = tiny_gateway_client, tiny_local_client
    through = gateway.chat.completions.create(model="t", messages=HELLO, max_tokens=4, n=2)
    direct = upstream.chat.completions.create(model="t", messages=HELLO, max_tokens=4, n=2)
    for mine, theirs in zip(through.choices, direct.choices, strict=True):
        assert_same_call(_fields(mine.message), _fields(theirs.message))
    chunks = list(gateway.chat.completions.create(model="t", messages=HELLO, max_tokens=4, n=2, stream=True))
    finals = {c.choices[0].index: c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason}
    assert sorted(finals) == [c.index for c in direct.choices]
    for choice in direct.choices:
        assert_same_call(_fields(finals[choice.index].delta), _fields(choice.message))


def test_required_prefix_is_forwarded_and_holds(tiny_gateway_client):
    gateway = tiny_gateway_client
    first = gateway.chat.completions.create(model="t", messages=HELLO, max_tokens=5).choices[0].message
    p, g, _ = _fields(first)
    messages = HELLO + [{"role": "assistant", "content": first.content}, {"role": "user", "content": "More."}]
    second = gateway.chat.completions.create(
        model="t", messages=messages, max_tokens=3, extra_body={"required_prefix_token_ids": p + g}
    )
    assert _fields(second.choices[0].message)[0][: len(p + g)] == p + g


def test_an_upstream_that_ignores_the_prefix_is_caught():

    def vllm(r):
        if r.method == "GET":
            return 200, {"object": "list", "data": [{"id": "m", "object": "model"}]}
        body = completion("hi", model="m")
        body["prompt_token_ids"] = [1, 2, 3]  # a stock vLLM renders the text; the prefix is ignored
        body["choices"][0]["token_ids"] = [7]
        body["choices"][0]["logprobs"] = {
            "content": [{"token": "token_id:7", "logprob": -0.5, "bytes": None, "top_logprobs": []}]
        }
        return 200, body

    backend = {"type": "chat", "return_token_id_information": True}
    with FakeServer(vllm) as fake, gateway({**backend, "base_urls": [fake.url + "/v1"]}) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        messages = HELLO + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
        with pytest.raises(openai.APIStatusError) as exc:
            client.chat.completions.create(
                model="m", messages=messages, max_tokens=1, extra_body={"required_prefix_token_ids": [1, 2, 4]}
            )
        assert exc.value.status_code == 502 and "ignores the field" in exc.value.body["message"]
        # The same prefix the server did use passes, and the field reached the server.
        client.chat.completions.create(
            model="m", messages=messages, max_tokens=1, extra_body={"required_prefix_token_ids": [1, 2]}
        )
        assert fake.requests[-1].body["required_prefix_token_ids"] == [1, 2]


def test_clouds_refuse_the_prefix(openai_fake):
    from helpers.fakes import CLOUD_KEY

    with gateway({"type": "openai", "base_url": openai_fake.url + "/v1", "api_key": CLOUD_KEY}) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model="gpt-test", input="x", extra_body={"required_prefix_token_ids": [1]})
    assert exc.value.body["param"] == "required_prefix_token_ids"
