"""Chat completions → Anthropic ``Message`` (``convert.chat_to_messages``), checked with the anthropic
SDK's own ``Message`` type."""

from __future__ import annotations

import pytest
from anthropic.types import Message

from gymserve.convert import chat_to_response
from gymserve.convert.chat_to_messages import (
    context_exceeded_message,
    matched_stop_sequence,
    response_to_message,
    thinking_signature,
    tool_input,
)
from helpers.fakes import completion

TOKENS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4, 5], "generation_log_probs": [-0.1, -0.2, -0.3]}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _message(comp, **kw):
    message = response_to_message(chat_to_response(comp, {"model": "m"}), **kw)
    Message.model_validate(message)  # the SDK's type accepts it (extra fields allowed)
    return message


def test_reasoning_text_and_tool_calls_become_blocks_in_order():
    comp = completion(
        "<think>plan it</think>Checking.",
        finish_reason="tool_calls",
        reasoning_content="first thought",
        tool_calls=[CALL],
        **TOKENS,
        weight_version=3,
    )
    message = _message(comp)
    assert message["content"] == [
        {"type": "thinking", "thinking": "first thought", "signature": thinking_signature("first thought")},
        {"type": "thinking", "thinking": "plan it", "signature": thinking_signature("plan it")},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert {k: message[k] for k in TOKENS} == TOKENS and message["weight_version"] == 3
    assert message["usage"] == {
        "input_tokens": 5,
        "output_tokens": 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")


@pytest.mark.parametrize(
    "finish, reason",
    [("stop", "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal"), ("abort", "pause_turn")],
)
def test_stop_reasons(finish, reason):
    assert _message(completion("x", finish_reason=finish))["stop_reason"] == reason


def test_a_refusal_is_text_with_stop_reason_refusal():
    message = _message(completion(None, refusal="I can't help with that."))
    assert message["content"] == [{"type": "text", "text": "I can't help with that."}]
    assert message["stop_reason"] == "refusal"


def test_a_matched_stop_sequence_is_reported():
    comp = completion("Paris", extra=None)
    comp["choices"][0]["stop_reason"] = "END"  # vLLM's field for the stop string that matched
    stop = matched_stop_sequence(comp["choices"][0], ["END", "STOP"])
    message = _message(comp, stop_sequence=stop)
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert matched_stop_sequence(comp["choices"][0], ["OTHER"]) is None
    comp["choices"][0]["stop_reason"] = 151645  # a stop token id, not a string of the request
    assert matched_stop_sequence(comp["choices"][0], ["END"]) is None


def test_cached_prompt_tokens_are_cache_reads():
    comp = completion("x")
    comp["usage"] = {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert _message(comp)["usage"] == {
        "input_tokens": 36,
        "output_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
    }


def test_an_empty_generation_still_carries_its_training_fields():
    message = _message(completion("", **TOKENS))
    assert message["content"] == [] and {k: message[k] for k in TOKENS} == TOKENS


@pytest.mark.parametrize(
    "arguments, expected",
    [('{"a": 1}', {"a": 1}), ("", {}), ("not json", {}), ("[1, 2]", {}), ('"s"', {}), (None, {}), ({"b": 2}, {"b": 2})],
)
def test_tool_input_is_always_an_object(arguments, expected):
    assert tool_input(arguments) == expected


def test_context_exceeded_message_is_empty_and_says_why():
    message = context_exceeded_message("m")
    Message.model_validate(message)
    assert message["content"] == [] and message["stop_reason"] == "model_context_window_exceeded"
    assert message["usage"]["input_tokens"] == message["usage"]["output_tokens"] == 0
