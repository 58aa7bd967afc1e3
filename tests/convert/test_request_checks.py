"""The checks both routes share (``convert.request_checks``): the other API's fields, nulls,
numbers and chat tools; what real clients send passes unchanged."""

from __future__ import annotations

import pytest

from gymserve.convert.request_checks import chat_tools, check_request
from gymserve.errors import InvalidRequestError
from helpers.apis import CHAT_ON_RESPONSES, RESPONSES_ON_CHAT

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("field", "value", "hint"), CHAT_ON_RESPONSES, ids=[f for f, _, _ in CHAT_ON_RESPONSES])
def test_chat_fields_on_responses_name_the_responses_field(field, value, hint):
    with pytest.raises(InvalidRequestError) as e:
        check_request({"input": "hi", field: value}, "responses")
    err = e.value.to_dict()["error"]
    assert (err["param"], err["code"], err["type"]) == (field, "unsupported_parameter", "invalid_request_error")
    assert err["message"].startswith(
        f"{field} is a Chat Completions field, not a Responses API one: on POST /v1/responses, "
    )
    assert hint in err["message"]


@pytest.mark.parametrize(("field", "value", "hint"), RESPONSES_ON_CHAT, ids=[f for f, _, _ in RESPONSES_ON_CHAT])
def test_responses_fields_on_chat_name_the_chat_field(field, value, hint):
    with pytest.raises(InvalidRequestError) as e:
        check_request({"messages": MSG, field: value}, "chat")
    err = e.value.to_dict()["error"]
    assert (err["param"], err["code"]) == (field, "unsupported_parameter")
    assert err["message"].startswith(
        f"{field} is a Responses API field, not a Chat Completions one: on POST /v1/chat/completions, "
    )
    assert hint in err["message"]


def test_what_real_clients_send_passes_unchanged():
    """NeMo Gym's chat body, vLLM's sampling extras, and gymserve's documented Responses extras."""
    nemo_gym_chat = {
        "model": "policy",
        "messages": MSG,
        "metadata": {"k": "v"},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": 64,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }
    vllm_extras = {
        "top_k": 20,
        "min_p": 0.1,
        "seed": 3,
        "skip_special_tokens": False,
        "repetition_penalty": 1.0,
        "chat_template_kwargs": {"enable_thinking": False},
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        "stop": ["\n"],
        "n": 1,
        "max_completion_tokens": 8,
    }
    body = {**nemo_gym_chat, **vllm_extras}
    assert check_request(body, "chat") is body
    responses = {
        "model": "policy",
        "input": "hi",
        "instructions": "i",
        "max_output_tokens": 8,
        "top_logprobs": 2,
        "seed": 1,
        "stop": "\n",
        "presence_penalty": 0.5,
        "frequency_penalty": 0.0,
        "store": False,
        "chat_template_kwargs": {},
        "tool_choice": "auto",
        "include": [],
        "text": {"format": {"type": "text"}},
    }
    assert check_request(responses, "responses") is responses


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_null_means_absent(api):
    base = {"input": "hi"} if api == "responses" else {"messages": MSG}
    # The other API's fields, too: a null one is absent, so it is no reason to refuse.
    nulls = {
        "model": None,
        "temperature": None,
        "tools": None,
        "max_tokens": None,
        "max_output_tokens": None,
        "stream": None,
        "metadata": None,
    }
    assert check_request({**base, **nulls}, api) == base


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": 3}, "model", "model must be a string, got a number"),
        ({"messages": None}, "messages", "messages is required: a non-empty list"),
        ({"messages": []}, "messages", "messages must be a non-empty list of messages, got an empty array"),
        ({"messages": "hi"}, "messages", "messages must be a non-empty list of messages, got a string"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens=0 is out of range: it must be at least 1"),
        ({"max_completion_tokens": -3}, "max_completion_tokens", "max_completion_tokens=-3 is out of range"),
        ({"max_tokens": 4.5}, "max_tokens", "max_tokens must be an integer, got a number (4.5)"),
        ({"n": 0}, "n", "n=0 is out of range: it must be at least 1"),
        ({"temperature": -1}, "temperature", "temperature=-1 is out of range: it must be at least 0"),
        ({"temperature": "hot"}, "temperature", "temperature must be a number, got a string ('hot')"),
        ({"top_p": 2}, "top_p", "top_p=2 is out of range: it must be from 0 to 1"),
        ({"top_logprobs": 50}, "top_logprobs", "top_logprobs=50 is out of range: it must be from 0 to 20"),
        ({"presence_penalty": 3}, "presence_penalty", "presence_penalty=3 is out of range: it must be from -2 to 2"),
        ({"seed": "7"}, "seed", "seed must be an integer, got a string ('7')"),
        ({"logprobs": "yes"}, "logprobs", "logprobs must be a boolean, got a string"),
        ({"tools": {"type": "function"}}, "tools", "tools must be an array of tools, got an object"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
            "tools[0].function",
            "tools[0].function is required",
        ),
        (
            {"tools": [{"type": "function", "function": "f"}]},
            "tools[0].function",
            "tools[0].function must be an object, got a string",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "city: string"}}]},
            "tools[0].function.parameters",
            "tools[0].function.parameters must be a JSON Schema object, got a string",
        ),
        (
            {"max_tokens": 1e30},
            "max_tokens",
            "max_tokens=1e+30 is out of range: it must be a 64-bit integer, at most 9223372036854775807",
        ),
        ({"seed": 2**64}, "seed", "seed=18446744073709551616 is out of range"),
        # Messages are checked as strictly as input items (message_checks; its tests have the rest).
        (
            {"messages": [*MSG, {"role": "tool", "content": "18 C"}]},
            "messages[1].tool_call_id",
            "messages[1].tool_call_id is required",
        ),
    ],
)
def test_bad_chat_requests_name_the_field(body, param, message):
    with pytest.raises(InvalidRequestError) as e:
        check_request({"messages": MSG, **body}, "chat")
    assert e.value.param == param and e.value.message.startswith(message), e.value.message


def test_a_responses_style_tool_on_chat_is_told_the_chat_shape():
    with pytest.raises(InvalidRequestError, match="this looks like a Responses API tool"):
        chat_tools([{"type": "function", "name": "f", "parameters": {}}], functions_only=False)


def test_other_tool_types_are_for_the_upstream_unless_only_functions_run():
    custom = [{"type": "custom", "name": "grammar"}]
    assert chat_tools(custom, functions_only=False) == custom
    with pytest.raises(InvalidRequestError) as e:
        chat_tools(custom, functions_only=True)
    assert e.value.param == "tools[0].type" and "'custom' is not supported: only function tools" in e.value.message
    with pytest.raises(InvalidRequestError, match=r'tools\[0\].type is required: "function"'):
        chat_tools([{"function": {"name": "f"}}], functions_only=True)


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequestError, match="must be a JSON object, got an array"):
        check_request([1], "chat")


def test_whole_numbers_for_integer_fields_go_on_as_integers():
    out = check_request({"messages": MSG, "max_tokens": 3.0, "seed": 1e3}, "chat")
    assert out["max_tokens"] == 3 and isinstance(out["max_tokens"], int) and out["seed"] == 1000
