"""Errors raised about the converted chat request are told in the Responses request's fields."""

from __future__ import annotations

import pytest

from gymserve.convert.field_paths import FieldPaths
from gymserve.convert.responses_to_chat import responses_to_chat
from gymserve.errors import InvalidRequestError, SpliceError

TOKENS = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [0.0]}
REQUEST = {
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", **TOKENS},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
    ],
    "max_output_tokens": 5,
}


@pytest.fixture
def paths() -> FieldPaths:
    paths = FieldPaths()
    chat = responses_to_chat(REQUEST, paths=paths)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    return paths


@pytest.mark.parametrize(
    ("chat", "responses"),
    [
        ("messages[0].content", "instructions"),
        ("messages[1].content[0].text", "input[0].content[0].text"),
        ("messages[1].role", "input[0].role"),
        ("messages[2].tool_calls[0].function.arguments", "input[2].arguments"),
        ("messages[2].tool_calls[0].function.name", "input[2].name"),
        ("messages[2].tool_calls[0].id", "input[2].call_id"),
        ("messages[2].reasoning_content", "input[1]"),
        ("messages[2].prompt_token_ids", "input[2].prompt_token_ids"),
        ("messages[2]", "input[1]"),
        ("messages[3].tool_call_id", "input[3].call_id"),
        ("messages[3].content", "input[3].output"),
        ("messages", "input"),
        ("max_tokens", "max_output_tokens"),
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema", "text.format.json_schema"),
        ("reasoning_effort", "reasoning.effort"),
        ("tools[1].function.parameters", "tools[1].parameters"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("temperature", "temperature"),
        ("messages[9].content", "messages[9].content"),  # no such message: left as it is
    ],
)
def test_chat_paths_in_responses_terms(paths, chat, responses):
    assert paths.chat_path(chat) == responses


def test_an_error_keeps_its_class_and_code_and_speaks_responses(paths):
    err = paths.translate(
        InvalidRequestError("max_tokens must be a positive integer, not max_tokens_x", param="max_tokens")
    )
    assert (err.param, err.message) == (
        "max_output_tokens",
        "max_output_tokens must be a positive integer, not max_tokens_x",
    )
    splice = paths.translate(SpliceError("cannot find the end of assistant turn messages[2] in messages[3]"))
    assert isinstance(splice, SpliceError) and splice.code == "splice_failed" and splice.status_code == 400
    assert splice.message == "cannot find the end of assistant turn input[1] in input[3]" and splice.param == "input"


MESSAGES_REQUEST = {
    "system": "Be brief.",
    "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "user", "content": [{"type": "text", "text": "In Paris."}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {}},
            ],
            **TOKENS,
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "18 C"}]},
    ],
    "max_tokens": 5,
}


@pytest.fixture
def messages_paths() -> FieldPaths:
    from gymserve.convert.field_paths import MESSAGES
    from gymserve.convert.messages_to_chat import messages_to_chat

    paths = FieldPaths(MESSAGES)
    chat = messages_to_chat(MESSAGES_REQUEST, paths=paths)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    return paths


@pytest.mark.parametrize(
    ("chat", "messages"),
    [
        ("messages[0].content", "system"),
        ("messages[1].content", "messages[0].content"),  # two user messages, one chat message
        ("messages[1].role", "messages[0].role"),
        ("messages[2].tool_calls[0].function.arguments", "messages[2].content[1].input"),
        ("messages[2].tool_calls[0].function.name", "messages[2].content[1].name"),
        ("messages[2].tool_calls[0].id", "messages[2].content[1].id"),
        ("messages[2].reasoning_content", "messages[2].content[0].thinking"),
        ("messages[2].prompt_token_ids", "messages[2].prompt_token_ids"),
        ("messages[3].tool_call_id", "messages[3].content[0].tool_use_id"),
        ("messages[3].content", "messages[3].content[0].content"),
        ("messages", "messages"),
        ("max_completion_tokens", "max_tokens"),
        ("stop", "stop_sequences"),
        ("response_format.json_schema", "output_config.format.json_schema"),
        ("reasoning_effort", "output_config.effort"),
        ("user", "metadata.user_id"),
        ("tools[1].function.parameters", "tools[1].input_schema"),
        ("tools[1].function.name", "tools[1].name"),
        ("tool_choice.function.name", "tool_choice.name"),
    ],
)
def test_chat_paths_in_messages_terms(messages_paths, chat, messages):
    assert messages_paths.chat_path(chat) == messages
