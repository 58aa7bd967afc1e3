"""The anthropic backend against a fake Anthropic Messages API on 127.0.0.1 (``anthropic_fake``: it
checks ``x-api-key``, ``anthropic-version``, the path and the body as Anthropic does), through the
real gymserve server, with the official anthropic and openai SDKs as clients: ``/v1/messages``
passes through (model replaced, training fields removed), chat and Responses are converted."""

from __future__ import annotations

import anthropic
import openai
import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.config import validate_config
from gymserve.server.run import start_background_server
from helpers.fakes import CLOUD_KEY, FakeServer, anthropic_error, anthropic_handler

TOKENS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}
TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _config(url: str, **backend):
    return validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "anthropic",
                "base_url": url,
                "api_key": CLOUD_KEY,
                "model": "claude-test",
                "max_retries": 1,
                "retry_backoff": 0,
                **backend,
            },
        }
    )


@pytest.fixture
def served(anthropic_fake):
    servers = []

    def start(**backend):
        srv = start_background_server(_config(anthropic_fake.url, **backend))
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def _messages_client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key="client-key", max_retries=0)


def _openai_client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="client-key", max_retries=0)


def _posts(fake, path="/v1/messages"):
    return [r for r in fake.requests if r.method == "POST" and r.path == path]


def test_messages_pass_through_with_the_upstreams_key_and_version(anthropic_fake, served):
    srv = served(extra_body={"service_tier": "auto"})
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello.", **TOKENS}], **TOKENS},
        {"role": "user", "content": "Tell me more."},
    ]
    m = _messages_client(srv).messages.create(model="whatever", max_tokens=32, messages=history, system="Be brief.")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "hello from anthropic"
    assert m.stop_reason == "end_turn" and m.usage.input_tokens == 10 and m.usage.cache_read_input_tokens == 3
    (sent,) = _posts(anthropic_fake)
    assert sent.headers["x-api-key"] == CLOUD_KEY and sent.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in sent.headers
    assert sent.body == {
        "model": "claude-test",
        "max_tokens": 32,
        "system": "Be brief.",
        "service_tier": "auto",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "Tell me more."},
        ],
    }


def test_streamed_messages_pass_through(anthropic_fake, served):
    srv = served()
    tools = [{"name": "get_weather", "input_schema": TOOLS_CHAT[0]["function"]["parameters"]}]
    with _messages_client(srv).messages.stream(
        model="claude-test", max_tokens=32, messages=[{"role": "user", "content": "Weather?"}], tools=tools
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].signature == "sig-1" and final.content[2].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    assert _posts(anthropic_fake)[0].body["stream"] is True


def test_chat_is_converted_to_a_messages_call(anthropic_fake, served):
    srv = served(default_max_tokens=100)
    r = _openai_client(srv).chat.completions.create(
        model="claude-test",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "toolu_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_0", "content": "21 C"},
            {"role": "user", "content": "And Paris?"},
        ],
        tools=TOOLS_CHAT,
        tool_choice="required",
        parallel_tool_calls=False,
        stop=["END?"],
        temperature=0.2,
    )
    (sent,) = _posts(anthropic_fake)
    assert sent.body == {
        "model": "claude-test",
        "system": "Be brief.",
        "max_tokens": 100,
        "temperature": 0.2,
        "stop_sequences": ["END?"],
        "tools": [
            {
                "name": "get_weather",
                "input_schema": TOOLS_CHAT[0]["function"]["parameters"],
                "description": "Weather of a city",
            }
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Rome"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_0", "content": "21 C"},
                    {"type": "text", "text": "And Paris?"},
                ],
            },
        ],
    }
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert message.tool_calls[0].id == "toolu_01" and message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens) == (13, 5, 3)


def test_chat_streams_from_messages_events(anthropic_fake, served):
    srv = served()
    stream = _openai_client(srv).chat.completions.create(
        model="claude-test",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS_CHAT,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    args = "".join(
        tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
    )
    assert content == "Let me check." and args == '{"city": "Paris"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.prompt_tokens == 13


@pytest.mark.parametrize("stream", [False, True])
def test_responses_go_through_the_chat_conversion(anthropic_fake, served, stream):
    srv = served()
    tools = [{"type": "function", **TOOLS_CHAT[0]["function"]}]
    client = _openai_client(srv)
    if stream:
        with client.responses.stream(model="claude-test", input="Weather?", tools=tools) as s:
            response = s.get_final_response()
    else:
        response = client.responses.create(model="claude-test", input="Weather?", tools=tools, max_output_tokens=50)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[2].arguments == '{"city": "Paris"}' and response.output[2].call_id == "toolu_01"
    sent = _posts(anthropic_fake)[0].body
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}]
    assert sent["max_tokens"] == (4096 if stream else 50)


def test_a_stop_sequence_is_reported_on_both_apis(anthropic_fake, served):
    srv = served()
    m = _messages_client(srv).messages.create(
        model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "x"}], stop_sequences=["END"]
    )
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")
    r = _openai_client(srv).chat.completions.create(
        model="claude-test", messages=[{"role": "user", "content": "x"}], stop="END"
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "END"


def test_count_tokens_passes_through(anthropic_fake, served):
    srv = served()
    counted = _messages_client(srv).messages.count_tokens(model="x", messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens == 42
    assert _posts(anthropic_fake, "/v1/messages/count_tokens")[0].body["model"] == "claude-test"


def test_context_overflow_ends_the_rollout_cleanly_on_every_api(served):
    srv = served()
    m = _messages_client(srv).messages.create(
        model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "overflow"}]
    )
    assert m.stop_reason == "model_context_window_exceeded" and m.content == []
    client = _openai_client(srv)
    r = client.chat.completions.create(model="claude-test", messages=[{"role": "user", "content": "overflow"}])
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    response = client.responses.create(model="claude-test", input="overflow")
    assert response.status == "incomplete" and response.output == []


def test_a_wrong_key_says_where_the_key_goes(anthropic_fake):
    srv = start_background_server(_config(anthropic_fake.url, api_key="wrong"))
    try:
        with pytest.raises(anthropic.APIStatusError) as exc:
            _messages_client(srv).messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        assert exc.value.status_code == 502 and exc.value.body["error"]["type"] == "api_error"
        assert "x-api-key" in exc.value.body["error"]["message"] and "wrong" not in exc.value.body["error"]["message"]
    finally:
        srv.stop()


def test_overloaded_upstream_is_retried():
    plan = [anthropic_error(529, "overloaded_error", "Overloaded")]
    inner = anthropic_handler(CLOUD_KEY, model="claude-test")
    with FakeServer(lambda r: plan.pop(0) if plan and r.method == "POST" else inner(r)) as fake:
        srv = start_background_server(_config(fake.url))
        try:
            m = _messages_client(srv).messages.create(
                model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
            assert m.content[0].text == "hello from anthropic" and len(_posts(fake)) == 2
        finally:
            srv.stop()


def test_an_unknown_field_is_refused_before_the_upstream_sees_it(anthropic_fake, served):
    srv = served()
    with pytest.raises(anthropic.BadRequestError) as exc:
        _messages_client(srv).messages.create(
            model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "x"}], extra_body={"nonsense": 1}
        )
    # gymserve's own 400 (server.known_fields), naming it; the upstream would say "Extra inputs".
    assert exc.value.body["error"]["message"].startswith("nonsense is not a field gymserve applies")
    assert not [r for r in anthropic_fake.requests if r.path == "/v1/messages"]


async def test_models_come_from_the_upstream(anthropic_fake):
    backend = build_backend(_config(anthropic_fake.url, model=None))
    try:
        assert await backend.models() == ["claude-test"]
        assert backend.describe()["target"] == anthropic_fake.url
    finally:
        await backend.close()


def test_a_base_url_ending_in_v1_is_taken_as_its_root(anthropic_fake):
    assert _config(anthropic_fake.url + "/v1/").backend.base_url == anthropic_fake.url


async def test_chat_fields_an_anthropic_upstream_cannot_honour_are_refused(anthropic_fake):
    backend = build_backend(_config(anthropic_fake.url))
    try:
        for field, value in (("logprobs", True), ("n", 2), ("seed", 7), ("frequency_penalty", 0.5)):
            with pytest.raises(Exception) as exc:
                await backend.chat({"messages": [{"role": "user", "content": "x"}], field: value}, RequestContext())
            assert getattr(exc.value, "param", None) == field and exc.value.status_code == 400
        assert not _posts(anthropic_fake)
    finally:
        await backend.close()


async def test_check_probes_every_api(anthropic_fake):
    from gymserve.check import run_check

    report = await run_check(_config(anthropic_fake.url))
    assert [(r.name, r.ok, r.required) for r in report.results] == [
        ("models", True, False),
        ("chat", True, True),
        ("responses", True, True),
        ("messages", True, True),
    ]
    assert CLOUD_KEY not in report.format()


async def test_a_required_token_prefix_is_refused_before_anything_is_sent(anthropic_fake):
    """Anthropic takes no token IDs: NeMo RL's required_prefix_token_ids is a 400 naming it on every
    API of this backend (Messages passed through included), never forwarded for Anthropic to refuse."""
    backend = build_backend(_config(anthropic_fake.url))
    hi = [{"role": "user", "content": "x"}]
    asks = {
        "messages": lambda: backend.messages(
            {"messages": hi, "max_tokens": 2, "required_prefix_token_ids": [1]}, RequestContext()
        ),
        "messages_stream": lambda: anext(
            aiter(
                backend.messages_stream(
                    {"messages": hi, "max_tokens": 2, "required_prefix_token_ids": [1]}, RequestContext()
                )
            )
        ),
        "count_tokens": lambda: backend.count_tokens(
            {"messages": hi, "required_prefix_token_ids": [1]}, RequestContext()
        ),
        "chat": lambda: backend.chat({"messages": hi, "required_prefix_token_ids": [1]}, RequestContext()),
    }
    try:
        for name, ask in asks.items():
            with pytest.raises(Exception) as exc:
                await ask()
            assert getattr(exc.value, "param", None) == "required_prefix_token_ids", name
            assert exc.value.status_code == 400, name
        assert not _posts(anthropic_fake) and not _posts(anthropic_fake, "/v1/messages/count_tokens")
    finally:
        await backend.close()
