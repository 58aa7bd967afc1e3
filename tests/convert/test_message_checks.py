"""Chat messages checked as strictly as Responses input items, on every route that takes them."""

from __future__ import annotations

import pytest

from gymserve.convert.message_checks import check_messages
from gymserve.convert.request_checks import check_request
from gymserve.errors import InvalidRequestError

MSG = [{"role": "user", "content": "hi"}]


CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        (["hi"], "messages[0]", "messages[0] must be a message object, got a string"),
        ([{"content": "x"}], "messages[0].role", "messages[0].role is required"),
        (
            [{"role": "function", "content": "x"}],
            "messages[0].role",
            "messages[0].role 'function' is not a role (deprecated by OpenAI",
        ),
        ([{"role": "user"}], "messages[0].content", "messages[0].content is required for a user message"),
        ([{"role": "user", "content": 3}], "messages[0].content", "messages[0].content must be a string or a list"),
        (
            [{"role": "user", "content": [{"text": "x"}]}],
            "messages[0].content[0]",
            "messages[0].content[0] must be a content part object with a type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text",
            "messages[0].content[0].text must be a string",
        ),
        (
            [*MSG, {"role": "tool", "content": "18 C"}],
            "messages[1].tool_call_id",
            "messages[1].tool_call_id is required",
        ),
        (
            [*MSG, {"role": "tool", "tool_call_id": "", "content": "x"}],
            "messages[1].tool_call_id",
            "messages[1].tool_call_id is required (a non-empty string), got an empty string",
        ),
        (
            [*MSG, {"role": "assistant", "tool_calls": {"id": "c"}}],
            "messages[1].tool_calls",
            "messages[1].tool_calls must be a list",
        ),
        (
            [*MSG, {"role": "assistant", "tool_calls": ["c"]}],
            "messages[1].tool_calls[0]",
            "messages[1].tool_calls[0] must be a tool call object, got a string",
        ),
        (
            [*MSG, {"role": "assistant", "tool_calls": [CALL]}],
            "messages[1].tool_calls[0].id",
            "messages[1].tool_calls[0].id is required",
        ),
        (
            [*MSG, {"role": "assistant", "tool_calls": [{**CALL, "id": "c", "type": "custom"}]}],
            "messages[1].tool_calls[0].type",
            'messages[1].tool_calls[0].type must be "function"',
        ),
        (
            [*MSG, {"role": "assistant", "tool_calls": [{"id": "c"}]}],
            "messages[1].tool_calls[0].function",
            "messages[1].tool_calls[0].function is required",
        ),
        (
            [*MSG, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
            "messages[1].tool_calls[0].function.name",
            "messages[1].tool_calls[0].function.name is required",
        ),
        (
            [*MSG, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}],
            "messages[1].tool_calls[0].function.arguments",
            "messages[1].tool_calls[0].function.arguments must be a JSON string",
        ),
    ],
)
def test_malformed_messages_name_the_field(messages, param, message):
    with pytest.raises(InvalidRequestError) as e:
        check_messages(messages)
    assert e.value.param == param and e.value.message.startswith(message), e.value.message


def test_the_list_is_named_as_the_route_names_it():
    with pytest.raises(InvalidRequestError) as e:
        check_messages([{"role": "tool", "content": "x"}], where="history")
    assert e.value.param == "history[0].tool_call_id"


def test_valid_messages_of_every_role_pass():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": [{"type": "text", "text": "d"}]},
        {"role": "user", "content": [{"type": "text", "text": "u"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ]
    assert check_request({"messages": messages}, "chat")["messages"] == messages
