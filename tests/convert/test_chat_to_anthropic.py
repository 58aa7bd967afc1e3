"""Chat Completions ⇄ an Anthropic Messages upstream (``convert.chat_to_anthropic``)."""

from __future__ import annotations

import pytest
from anthropic.types import MessageCreateParams
from pydantic import TypeAdapter

from gymserve.convert import ChunkAccumulator
from gymserve.convert.chat_to_anthropic import ChunksFromEvents, chat_to_messages_request, message_to_chat_completion
from gymserve.errors import InvalidRequestError
from helpers.fakes import anthropic_events, anthropic_message

TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def test_a_chat_conversation_becomes_a_valid_messages_request():
    body = chat_to_messages_request(
        {
            "model": "claude-test",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in these?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": "Two calls.",
                    "reasoning_content": "dropped: no signature to send back",
                    "tool_calls": [
                        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "not json"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": "one"},
                {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "two"}]},
            ],
            "max_completion_tokens": 50,
            "user": "u-1",
            "reasoning_effort": "high",
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
            "tool_choice": "none",
        },
        default_max_tokens=4096,
    )
    TypeAdapter(MessageCreateParams).validate_python(body)
    assert body["system"] == "Be brief.\n\nUse tools."
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in these?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Two calls."},
                {"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}},
                {"type": "tool_use", "id": "b", "name": "f", "input": {}},
            ],
        },
        {
            "role": "user",  # both results in the one user turn after the tool_use
            "content": [
                {"type": "tool_result", "tool_use_id": "a", "content": "one"},
                {"type": "tool_result", "tool_use_id": "b", "content": "two"},
            ],
        },
    ]
    assert (
        body["max_tokens"] == 50 and body["metadata"] == {"user_id": "u-1"} and body["tool_choice"] == {"type": "none"}
    )
    assert body["output_config"] == {"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}}


def test_the_default_max_tokens_fills_in():
    body = chat_to_messages_request({"messages": [{"role": "user", "content": "x"}]}, default_max_tokens=77)
    assert body == {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "max_tokens": 77}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_what_cannot_be_honoured_is_refused(change, param):
    with pytest.raises(InvalidRequestError) as exc:
        chat_to_messages_request({"messages": [{"role": "user", "content": "x"}], **change}, default_max_tokens=8)
    assert exc.value.param == param


@pytest.mark.parametrize(
    "stop, finish",
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("tool_use", "tool_calls"),
        ("max_tokens", "length"),
        ("model_context_window_exceeded", "length"),
        ("refusal", "content_filter"),
        ("pause_turn", "stop"),
    ],
)
def test_stop_reasons_become_finish_reasons(stop, finish):
    message = {**anthropic_message({"messages": []}, "claude-test"), "stop_reason": stop}
    assert message_to_chat_completion(message)["choices"][0]["finish_reason"] == finish


def test_a_message_and_its_event_stream_give_the_same_completion():
    message = anthropic_message({"messages": [], "tools": TOOLS}, "claude-test")
    whole = message_to_chat_completion(message)
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "The user wants the weather.",
        "reasoning": "The user wants the weather.",
        "tool_calls": [
            {
                "id": "toolu_01",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert whole["usage"] == {
        "prompt_tokens": 13,
        "completion_tokens": 5,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    chunks = ChunksFromEvents(include_usage=True)
    accumulator = ChunkAccumulator()
    for event in anthropic_events(message):
        for chunk in chunks.feed(event):
            accumulator.add(chunk)
    folded = accumulator.completion()
    assert folded["choices"][0]["finish_reason"] == "tool_calls"
    assert {k: v for k, v in folded["choices"][0]["message"].items() if k != "reasoning"} == {
        k: v for k, v in whole["choices"][0]["message"].items() if k != "reasoning"
    }
    assert folded["usage"] == whole["usage"] and folded["model"] == "claude-test"
