"""POST /tokenize and /detokenize (vLLM's shapes) on the local backend and over the chat backend: the
chat form answers exactly the prompt IDs generation sees for the same messages, splice included."""

from __future__ import annotations

import httpx
import openai
import pytest

from helpers.servers import gateway

FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _root(server) -> str:
    return server.base_url.removesuffix("/v1")


def _tokenize(server, body):
    r = httpx.post(_root(server) + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _rollout(server):
    """Two turns through the chat route; the second message list carries the first turn's fields."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="t", messages=messages, max_tokens=6).choices[0].message
    fields = {f: first.model_extra[f] for f in FIELDS}
    messages += [{"role": "assistant", "content": first.content, **fields}, {"role": "user", "content": "Another?"}]
    second = client.chat.completions.create(model="t", messages=messages, max_tokens=2).choices[0].message
    return messages, fields, second.model_extra["prompt_token_ids"]


def test_prompt_form(tiny_local_server, tokenizer):
    out = _tokenize(tiny_local_server, {"prompt": "Hello world", "return_token_strs": True})
    assert out == {"count": 2, "max_model_len": 512, "tokens": [9707, 1879], "token_strs": ["Hello", "Ġworld"]}
    assert _tokenize(tiny_local_server, {"prompt": "Hello"})["token_strs"] is None


def test_chat_form_is_what_generation_sees_splice_included(tiny_local_server):
    messages, fields, prompt = _rollout(tiny_local_server)
    out = _tokenize(tiny_local_server, {"messages": messages})
    assert out["tokens"] == prompt and out["count"] == len(prompt)
    prefix = fields["prompt_token_ids"] + fields["generation_token_ids"]
    assert out["tokens"][: len(prefix)] == prefix
    # required_prefix_token_ids instead of the fields: the same IDs.
    bare = [{k: v for k, v in m.items() if k not in FIELDS} for m in messages]
    assert _tokenize(tiny_local_server, {"messages": bare, "required_prefix_token_ids": prefix})["tokens"] == prompt


def test_chat_form_options(tiny_local_server, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    with_prompt = _tokenize(tiny_local_server, {"messages": messages})["tokens"]
    without = _tokenize(tiny_local_server, {"messages": messages, "add_generation_prompt": False})["tokens"]
    assert tokenizer.decode(with_prompt[len(without) :]) == "<|im_start|>assistant\n"
    cont = messages + [{"role": "assistant", "content": "Hel"}]
    out = _tokenize(
        tiny_local_server, {"messages": cont, "continue_final_message": True, "add_generation_prompt": False}
    )
    assert tokenizer.decode(out["tokens"]).endswith("assistant\nHel")


def test_detokenize_round_trip(tiny_local_server):
    ids = _tokenize(tiny_local_server, {"messages": [{"role": "user", "content": "Hi"}]})["tokens"]
    text = httpx.post(_root(tiny_local_server) + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, "chat_template"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "required_prefix_token_ids": [1]},
            "required_prefix_token_ids",
        ),
        (
            "/tokenize",
            {
                "messages": [{"role": "user", "content": "x"}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            "continue_final_message",
        ),
        ("/detokenize", {"tokens": [1, 151936]}, "tokens[1]"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
    ],
)
def test_bad_requests_are_400s(tiny_local_server, path, body, param):
    r = httpx.post(_root(tiny_local_server) + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_backend_forwards_to_the_upstreams_tokenize(tiny_gateway, tiny_local_server):
    messages, _, prompt = _rollout(tiny_local_server)
    assert _tokenize(tiny_gateway, {"messages": messages})["tokens"] == prompt
    r = httpx.post(_root(tiny_gateway) + "/detokenize", json={"tokens": [9707, 1879]}, timeout=30)
    assert r.json() == {"prompt": "Hello world"}


def test_chat_backend_answers_from_its_own_tokenizer(tiny_model_dir, tiny_local_server):
    """backend.tokenizer: no request reaches the upstream's /tokenize, and the answer (splice
    applied) is the one the local backend gives for the same messages."""
    from helpers.fakes import ChatScript, FakeServer

    messages, _, prompt = _rollout(tiny_local_server)
    with FakeServer(ChatScript()) as fake:
        with gateway({"type": "chat", "base_urls": [fake.url + "/v1"], "tokenizer": str(tiny_model_dir)}) as srv:
            out = _tokenize(srv, {"messages": messages})
            assert out["tokens"] == prompt and out["max_model_len"] == 4096  # the model's max_position_embeddings
            assert _tokenize(srv, {"prompt": "Hello world"})["tokens"] == [9707, 1879]
            r = httpx.post(_root(srv) + "/detokenize", json={"tokens": [9707, 1879]}, timeout=30)
            assert r.json() == {"prompt": "Hello world"}
    assert not [r for r in fake.requests if r.path in ("/tokenize", "/detokenize")]


def test_upstream_without_tokenize_says_what_to_do():
    from helpers.fakes import ChatScript, FakeServer

    with FakeServer(ChatScript()) as fake, gateway({"type": "chat", "base_urls": [fake.url + "/v1"]}) as srv:
        r = httpx.post(_root(srv) + "/tokenize", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 502 and "backend.tokenizer" in r.json()["error"]["message"]


def test_clouds_cannot_tokenize(openai_fake):
    from helpers.fakes import CLOUD_KEY

    with gateway({"type": "openai", "base_url": openai_fake.url + "/v1", "api_key": CLOUD_KEY}) as srv:
        r = httpx.post(_root(srv) + "/tokenize", json={"prompt": "x"}, timeout=30)
        c = httpx.post(srv.base_url + "/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 501 and r.json()["error"]["code"] == "route_not_supported"
    # /v1/completions is forwarded to the cloud's own (OpenAI serves it for its instruct models);
    # this fake serves none, and the 502 names the route to use.
    assert c.status_code == 502 and "/v1/chat/completions" in c.json()["error"]["message"]
    assert [r.path for r in openai_fake.requests if r.method == "POST"] == ["/v1/completions"]
