"""The real embedded model (Qwen2.5-Coder-0.5B-Instruct) behind the server: few, short calls,
one loaded copy for the module."""

from __future__ import annotations

import json

import openai
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
from gymserve.harness.verify import teacher_forced_log_probs
from gymserve.protocol import TRAINING_FIELDS
from gymserve.server.run import start_background_server

pytestmark = pytest.mark.real_model

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def real_server(embedded_dir):
    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(model="embedded", sampling=SamplingConfig(temperature=0)),
    )
    srv = start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0, timeout=300)


def test_tool_call_then_answer_is_token_contiguous_and_exact(client, real_server):
    """Turn 1: the model's bare-JSON answer becomes a function_call item; turn 2 (after the tool
    output) starts with turn 1's prompt + generation; every log-prob matches teacher forcing."""
    inp = [{"role": "user", "content": "What is the weather in Paris?"}]
    r1 = client.responses.create(model="m", input=inp, tools=[WEATHER_TOOL], max_output_tokens=48)
    items = [it.model_dump(exclude_none=True) for it in r1.output]
    calls = [it for it in items if it["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather", items
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    t1 = items[-1]
    inp += items + [{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "18C, sunny"}]
    r2 = client.responses.create(model="m", input=inp, tools=[WEATHER_TOOL], max_output_tokens=8)
    t2 = r2.output[-1].model_extra
    p1, g1 = t1["prompt_token_ids"], t1["generation_token_ids"]
    assert t2["prompt_token_ids"][: len(p1) + len(g1)] == p1 + g1
    model = real_server.backend.engine.model
    for t in (t1, t2):
        tf = teacher_forced_log_probs(model, t["prompt_token_ids"], t["generation_token_ids"])
        assert max(abs(a - b) for a, b in zip(tf, t["generation_log_probs"])) <= 1e-4


def test_the_sampled_eos_is_a_training_token(client, real_server, tokenizer):
    """The issue's probe (vLLM 0.32 on CPU, same model and prompt, ``return_token_ids``: ``token_ids:
    [3925, 151645]``, both with log-probs, ``completion_tokens: 2``): the model's own ``<|im_end|>``
    ends the generation with its log-prob, on chat and on completions, in gymserve's fields and in
    vLLM's; the text shows "OK" only; the next turn's prompt holds that EOS once, and every log-prob
    (the EOS's included) matches teacher forcing."""
    messages = [{"role": "user", "content": "Reply with only the word OK."}]
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, logprobs=True, extra_body={"return_token_ids": True}
    )
    choice, extra = r.choices[0], r.choices[0].message.model_extra
    assert choice.finish_reason == "stop" and choice.message.content == "OK"
    assert extra["generation_token_ids"] == [3925, 151645] == choice.model_extra["token_ids"]
    assert r.usage.completion_tokens == 2 and len(choice.logprobs.content) == 2
    assert [e.token for e in choice.logprobs.content] == ["OK", "<|im_end|>"]
    model = real_server.backend.engine.model
    tf = teacher_forced_log_probs(model, extra["prompt_token_ids"], extra["generation_token_ids"])
    assert max(abs(a - b) for a, b in zip(tf, extra["generation_log_probs"])) <= 1e-4
    done = client.completions.create(model="m", prompt=extra["prompt_token_ids"], max_tokens=8, logprobs=0)
    assert done.choices[0].model_extra["generation_token_ids"] == [3925, 151645] and done.choices[0].text == "OK"
    assert done.usage.completion_tokens == 2
    # Next turn: P + G (its EOS included) + "\n<|im_start|>user..." — no second <|im_end|>.
    messages += [
        {"role": "assistant", "content": "OK", **{k: extra[k] for k in TRAINING_FIELDS}},
        {"role": "user", "content": "Again."},
    ]
    nxt = client.chat.completions.create(model="m", messages=messages, max_tokens=4).choices[0].message.model_extra
    head = extra["prompt_token_ids"] + extra["generation_token_ids"]
    assert nxt["prompt_token_ids"][: len(head)] == head
    assert tokenizer.decode(nxt["prompt_token_ids"][len(head) :]).startswith("\n<|im_start|>user\nAgain.")
