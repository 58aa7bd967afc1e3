"""gpt-oss harmony end to end, with the official SDK: the local engine (synthetic o200k_harmony
control tokens, gymserve's harmony template, a scripted engine) and the chat backend's raw-text path.

The local engine's turns are token-contiguous: each prompt starts with the previous prompt +
generation — the sampled ``<|call|>`` / ``<|return|>`` included, as vLLM returns them — and what
follows is the harmony the format prescribes (the tool output message, the next user turn), with no
second end-of-turn token after the model's own."""

from __future__ import annotations

import contextlib

import openai
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, SamplingConfig, validate_config
from gymserve.prompting.harmony_template import HARMONY_TEMPLATE
from gymserve.server.run import start_background_server
from helpers import synthetic_tokenizer as syn
from helpers.fakes import ChatScript, FakeServer, ScriptedEngine, completion, sse
from helpers.fakes import chat_chunks as fake_chunks

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
ANALYSIS = "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>'
FINAL = (
    "<|channel|>analysis<|message|>Tool says 20.<|end|><|start|>assistant<|channel|>final<|message|>20 °C.<|return|>"
)


@pytest.fixture(scope="module")
def harmony_tokenizer():
    return syn.synthetic_tokenizer(syn.HARMONY, HARMONY_TEMPLATE, eos_token="<|return|>")


@contextlib.contextmanager
def local_harmony(tokenizer, engine):
    engine.vocab_size = syn.HARMONY_VOCAB_SIZE  # gpt-oss's embedding rows, not the synthetic vocabulary's
    config = LocalBackendConfig(
        model="scripted",
        chat_template="harmony",
        tool_parser="openai",
        reasoning_parser="openai_gptoss",
        sampling=SamplingConfig(temperature=0.0),
    )
    cfg = validate_config({"server": {"port": 0}, "backend": config.model_dump()})
    with start_background_server(cfg, backend_factory=lambda: LocalBackend(config, engine, tokenizer)) as srv:
        yield openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=30)


def test_local_harmony_rollout_is_token_contiguous_and_parsed(harmony_tokenizer):
    tok = harmony_tokenizer
    engine = ScriptedEngine(tok, ANALYSIS + CALL, eos_tokens=("<|return|>", "<|call|>"), model_type="gpt_oss")
    with local_harmony(tok, engine) as client:
        first = client.responses.create(model="m", input="Weather in Oslo?", tools=TOOLS)
        kinds = [item.type for item in first.output]
        assert kinds == ["reasoning", "function_call"]
        assert first.output[0].content[0].type == "reasoning_text"
        assert first.output[0].content[0].text == "Need the weather tool."
        call = first.output[1]
        assert (call.name, call.arguments) == ("get_weather", '{"city":"Oslo"}')
        items = [i.model_dump(exclude_none=True) for i in first.output]
        p1, g1 = items[-1]["prompt_token_ids"], items[-1]["generation_token_ids"]
        # The sampled <|call|> is a training token: it ends the generation, with its log-prob.
        assert tok.decode(g1, skip_special_tokens=False) == ANALYSIS + CALL
        assert len(items[-1]["generation_log_probs"]) == len(g1)

        engine.text_ids = tok.encode(FINAL, add_special_tokens=False)
        history = [
            "Weather in Oslo?",
            *items,
            {"type": "function_call_output", "call_id": call.call_id, "output": "20"},
        ]
        second = client.responses.create(
            model="m", input=[{"role": "user", "content": history[0]}, *history[1:]], tools=TOOLS
        )
        assert second.output_text == "20 °C."
        assert [i.type for i in second.output] == ["reasoning", "message"]
        last = second.output[-1].model_dump(exclude_none=True)
        p2, g2 = last["prompt_token_ids"], last["generation_token_ids"]
        assert p2[: len(p1) + len(g1)] == p1 + g1
        assert tok.decode(p2[len(p1) + len(g1) :], skip_special_tokens=False) == (
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20<|end|><|start|>assistant"
        )

        engine.text_ids = tok.encode("<|channel|>final<|message|>Bye.<|return|>", add_special_tokens=False)
        third = client.responses.create(
            model="m",
            input=[
                {"role": "user", "content": "Weather in Oslo?"},
                *history[1:],
                *[i.model_dump(exclude_none=True) for i in second.output],
                {"role": "user", "content": "Thanks"},
            ],
            tools=TOOLS,
        )
        p3 = third.output[-1].model_dump(exclude_none=True)["prompt_token_ids"]
        assert p3[: len(p2) + len(g2)] == p2 + g2
        # The sampled <|return|> closes the answer in the next prompt (the model's own token, where
        # harmony's history would write <|end|>): the template's <|end|> is not added after it.
        assert tok.decode(g2, skip_special_tokens=False).endswith("20 °C.<|return|>")
        assert tok.decode(p3[len(p2) + len(g2) :], skip_special_tokens=False) == (
            "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
        )


def test_reasoning_effort_reaches_the_harmony_system_message(harmony_tokenizer):
    tok = harmony_tokenizer
    engine = ScriptedEngine(tok, "<|channel|>final<|message|>Hi.", eos_tokens=("<|return|>", "<|call|>"))
    with local_harmony(tok, engine) as client:
        out = client.responses.create(model="m", input="Hi", reasoning={"effort": "high"})
        prompt = tok.decode(out.output[-1].model_dump()["prompt_token_ids"], skip_special_tokens=False)
        assert out.output_text == "Hi." and "\nReasoning: high\n" in prompt
        default = client.responses.create(model="m", input="Hi")
        assert "\nReasoning: medium\n" in tok.decode(default.output[-1].model_dump()["prompt_token_ids"])


def test_local_harmony_chat_stream_equals_the_whole_answer(harmony_tokenizer):
    tok = harmony_tokenizer
    engine = ScriptedEngine(tok, ANALYSIS + CALL, eos_tokens=("<|return|>", "<|call|>"), model_type="gpt_oss")
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with local_harmony(tok, engine) as client:
        whole = client.chat.completions.create(model="m", messages=messages, tools=chat_tools)
        with client.chat.completions.stream(model="m", messages=messages, tools=chat_tools) as stream:
            final = stream.get_final_completion()
    for c in (whole, final):
        msg = c.choices[0].message
        assert c.choices[0].finish_reason == "tool_calls"
        assert not msg.content and msg.model_dump()["reasoning_content"] == "Need the weather tool."
        assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [("get_weather", '{"city":"Oslo"}')]


def test_chat_backend_parses_raw_harmony_text(harmony_tokenizer):
    raw = "<|channel|>analysis<|message|>Need the weather tool.<|end|>" + CALL.removesuffix("<|call|>")
    comp = completion(raw)
    script = ChatScript(default=lambda r: sse(fake_chunks(comp)) if r.body.get("stream") else (200, comp))
    with FakeServer(script) as upstream:
        cfg = validate_config(
            {
                "server": {"port": 0},
                "backend": {"type": "chat", "base_urls": [upstream.url + "/v1"], "tool_parser": "openai"},
            }
        )
        with start_background_server(cfg) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=30)
            full = client.responses.create(model="m", input="Weather in Oslo?", tools=TOOLS)
            with client.responses.stream(model="m", input="Weather in Oslo?", tools=TOOLS) as stream:
                streamed = stream.get_final_response()
    for r in (full, streamed):
        assert [i.type for i in r.output] == ["reasoning", "function_call"]
        assert r.output[0].content[0].text == "Need the weather tool."
        assert (r.output[1].name, r.output[1].arguments) == ("get_weather", '{"city":"Oslo"}')
