"""The sampled stop token is a training token, on every route, on each in-process CPU engine.

vLLM returns the EOS or stop token that ended a generation in ``token_ids``, with its log-prob, and
counts it in ``usage.completion_tokens``; its text does not show it. gymserve's training fields do
the same on Chat Completions, Completions, Responses and Messages, streamed or not. The tiny model
samples with a fixed seed here (the same tokens on every call), and a ``stop_token_ids`` token it
samples early (found by a first call) ends each generation: the same rule as the model's own EOS
(the real model's ``<|im_end|>``: ``tests/e2e/test_real_model.py``), on a model that rarely
samples its EOS.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
from gymserve.server.run import start_background_server

PROMPTS = ("Hello", "Tell me a story.", "Name a colour.", "What is 2 + 2?", "Write a poem about the sea.")


def _server(model_dir, engine, **sampling):
    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(
            model=str(model_dir), engine=engine, sampling=SamplingConfig(temperature=1.0, seed=1234, **sampling)
        ),
    )
    return start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))


@pytest.fixture(scope="module")
def stopped(local_engine):
    """``(server, messages, prompt, ids, log_probs)``: a server whose ``stop_token_ids`` holds a token
    the model samples (seeded) for ``messages`` (the first of ``PROMPTS`` where some token after the
    first is new), and that call's prompt and tokens up to that stop token with their log-probs, as a
    server without the stop token sampled them."""
    engine, model = local_engine
    probe = _server(model, engine)
    try:
        c = openai.OpenAI(base_url=probe.base_url, api_key="x", max_retries=0)
        for text in PROMPTS:
            messages = [{"role": "user", "content": text}]
            msg = c.chat.completions.create(model="t", messages=messages, max_tokens=8).choices[0].message.model_extra
            ids, lps = msg["generation_token_ids"], msg["generation_log_probs"]
            k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
            if k is not None:
                break
        else:
            pytest.fail(f"the tiny model repeats one token for every prompt of {PROMPTS}")
    finally:
        probe.stop()
    srv = _server(model, engine, stop_token_ids=[ids[k]])
    yield srv, messages, msg["prompt_token_ids"], ids[: k + 1], lps[: k + 1]
    srv.stop()


def _check(fields: dict, ids: list[int], lps: list[float]) -> None:
    assert fields["generation_token_ids"] == ids  # the stop token is the last generation token
    assert fields["generation_log_probs"] == pytest.approx(lps, abs=1e-4)


def test_chat_keeps_the_stop_token_with_its_log_prob(stopped, tokenizer):
    srv, messages, prompt, ids, lps = stopped
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    r = c.chat.completions.create(model="t", messages=messages, max_tokens=8, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    _check(choice.message.model_extra, ids, lps)
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(lps, abs=1e-4)
    assert choice.logprobs.content[-1].token == tokenizer.decode([ids[-1]])
    assert r.usage.completion_tokens == len(ids)
    # The text shows the tokens before the stop token, as vLLM's does.
    assert choice.message.content == tokenizer.decode(ids[:-1])


def test_chat_stream_keeps_the_stop_token(stopped, tokenizer):
    srv, messages, prompt, ids, lps = stopped
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    stream = c.chat.completions.create(
        model="t",
        messages=messages,
        max_tokens=8,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [ch.model_dump() for ch in stream]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    final = next(ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"])
    assert final["finish_reason"] == "stop" and text == tokenizer.decode(ids[:-1])
    _check(final["delta"], ids, lps)
    assert len(final["logprobs"]["content"]) == len(ids)
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_keep_the_stop_token(stopped, tokenizer, stream):
    srv, messages, prompt, ids, lps = stopped
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    body = {"model": "t", "prompt": prompt, "max_tokens": 8, "logprobs": 0}
    if stream:
        chunks = [ch.model_dump() for ch in c.completions.create(**body, stream=True)]
        text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
        choice = next(ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"])
    else:
        done = c.completions.create(**body)
        choice, text = done.choices[0].model_dump(), done.choices[0].text
        assert done.usage.completion_tokens == len(ids)
    assert choice["finish_reason"] == "stop" and text == tokenizer.decode(ids[:-1])
    _check(choice, ids, lps)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-4)


def test_responses_keep_the_stop_token(stopped, tokenizer):
    srv, messages, prompt, ids, lps = stopped
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    r = c.responses.create(model="t", input=messages[0]["content"], max_output_tokens=8)
    _check(r.output[-1].model_dump(), ids, lps)
    assert r.output_text == tokenizer.decode(ids[:-1]) and r.usage.output_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_keep_the_stop_token(stopped, tokenizer, stream):
    srv, messages, prompt, ids, lps = stopped
    body = {"model": "t", "max_tokens": 8, "messages": messages, "stream": stream}
    r = httpx.post(srv.base_url + "/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        delta = next(e for e in events if e["type"] == "message_delta")
        fields, usage = delta, delta["usage"]
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    else:
        message = r.json()
        fields, usage = message, message["usage"]
        text = "".join(b.get("text", "") for b in message["content"])
    _check(fields, ids, lps)
    assert usage["output_tokens"] == len(ids) and text == tokenizer.decode(ids[:-1])


def test_three_turns_keep_each_stop_token_in_the_next_prompt(stopped, tokenizer):
    """Turn k+1's prompt starts with turn k's prompt + generation, the stop token included, and
    the template's end-of-turn token follows it (a stop token that is not an EOS does not close
    the turn, so the template still does)."""
    srv, messages, prompt, ids, lps = stopped
    c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    messages = list(messages)
    prev = None
    for turn in range(3):
        msg = c.chat.completions.create(model="t", messages=messages, max_tokens=8).choices[0].message
        fields = msg.model_extra
        if prev is not None:
            head = prev["prompt_token_ids"] + prev["generation_token_ids"]
            assert fields["prompt_token_ids"][: len(head)] == head
            # Exactly one end-of-turn token: the model's own EOS when it sampled one, else the template's.
            closed = prev["generation_token_ids"][-1] in (151645, 151643)
            after = "\n<|im_start|>user" if closed else "<|im_end|>\n<|im_start|>user"
            assert tokenizer.decode(fields["prompt_token_ids"][len(head) :]).startswith(after)
        prev = fields
        messages += [
            {"role": "assistant", "content": msg.content, **{k: fields[k] for k in _TRAINING}},
            {"role": "user", "content": f"turn {turn + 2}"},
        ]


_TRAINING = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
