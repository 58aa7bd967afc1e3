"""Round trips (Response output fed back as input) and property-based tests over item sequences."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gymserve.convert import ConvertOptions, chat_to_response, responses_to_chat
from gymserve.errors import InvalidRequestError
from helpers.spec import assert_valid_response

TOKENS = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [7, 8], "generation_log_probs": [-0.5, -1.5]}


def completion_of(message, finish_reason="stop"):
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "finish_reason": finish_reason, "message": copy.deepcopy(message)}],
    }


DEFAULT_OPTIONS = ConvertOptions()


def replay(message, options=DEFAULT_OPTIONS, finish_reason="stop"):
    """Turn k's chat message → Response → turn k+1's input → the rebuilt chat message."""
    response = chat_to_response(completion_of(message, finish_reason), {"model": "m", "input": "q"})
    assert_valid_response(response)
    items = [{"role": "user", "content": "q"}, *response["output"]]
    items += [
        {"type": "function_call_output", "call_id": tc["id"], "output": "ok"} for tc in message.get("tool_calls") or []
    ]
    items.append({"role": "user", "content": "next"})
    chat = responses_to_chat({"model": "m", "input": items}, options)
    return chat["messages"][1]


def call(call_id, name="f", arguments='{"a": 1}'):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "hello"},
        {"role": "assistant", "content": "hello", "reasoning_content": "why", **TOKENS},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "r",
            "tool_calls": [call("c1"), call("c2", "g")],
            **TOKENS,
        },
        {"role": "assistant", "content": "Sure.", "tool_calls": [call("c1", arguments="")]},
        {"role": "assistant", "content": None, "reasoning_content": "only thinking", **TOKENS},
    ],
)
def test_round_trip_reproduces_the_assistant_message(message):
    expected = copy.deepcopy(message)
    for tc in expected.get("tool_calls") or []:
        tc["function"]["arguments"] = tc["function"]["arguments"] or "{}"  # the one normalisation (CR-04)
    assert replay(message) == expected


def test_round_trip_with_think_tags():
    message = {"role": "assistant", "content": "<think>\nr\n</think>\n\nhello", **TOKENS}
    assert replay(message, ConvertOptions(reasoning_mode="think_tags")) == message


def test_round_trip_reasoning_field_name():
    message = {"role": "assistant", "content": "x", "reasoning": "r"}
    assert replay(message, ConvertOptions(reasoning_mode="reasoning")) == message


def test_round_trip_of_a_truncated_turn_keeps_tokens():
    message = {"role": "assistant", "content": None, **TOKENS}
    response = chat_to_response(completion_of(message, "length"), {"model": "m", "input": "q"})
    back = responses_to_chat(
        {"model": "m", "input": [{"role": "user", "content": "q"}, *response["output"]]}, ConvertOptions()
    )
    assistant = back["messages"][-1]
    assert assistant["role"] == "assistant" and assistant["generation_token_ids"] == [7, 8]


# -- property-based ----------------------------------------------------------------------------

_text = st.text(min_size=1, max_size=12).filter(lambda s: s.strip() and "<think>" not in s and "</think>" not in s)
_ids = st.text(alphabet="abcdefghij0123456789", min_size=1, max_size=6)
_args = st.sampled_from(['{"a": 1}', "{}", '{"q": "x y"}'])


@given(
    content=st.none() | _text,
    reasoning=st.none() | _text,
    calls=st.lists(st.tuples(_ids, _text, _args), max_size=4, unique_by=lambda c: c[0]),
    with_tokens=st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_round_trip_property(content, reasoning, calls, with_tokens):
    # A turn with nothing to show has no output item; its training fields sit on the response
    # (test_round_trip_of_a_truncated_turn_keeps_tokens), so there is nothing to replay.
    assume(content or reasoning or calls)
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [call(f"call_{i}", name, args) for i, name, args in calls]
    if with_tokens:
        message.update(TOKENS)
    assert replay(message, finish_reason="tool_calls" if calls else "stop") == message


def _user():
    return st.builds(lambda t: {"role": "user", "content": t}, _text)


def _reasoning():
    return st.builds(
        lambda t, where: (
            {"type": "reasoning", "summary": [], where: [{"type": "reasoning_text", "text": t}]}
            if where == "content"
            else {"type": "reasoning", "summary": [{"type": "summary_text", "text": t}]}
        ),
        _text,
        st.sampled_from(["content", "summary"]),
    )


def _assistant():
    return st.builds(
        lambda t, parts: {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": t}] if parts else t,
        },
        _text,
        st.booleans(),
    )


def _fc():
    return st.builds(
        lambda i, n, a, tok: {
            "type": "function_call",
            "call_id": f"call_{i}",
            "name": n,
            "arguments": a,
            **(TOKENS if tok else {}),
        },
        _ids,
        _text,
        _args,
        st.booleans(),
    )


def _fco():
    return st.builds(lambda i, o: {"type": "function_call_output", "call_id": f"call_{i}", "output": o}, _ids, _text)


def _sys():
    return st.builds(lambda r, t: {"role": r, "content": t}, st.sampled_from(["system", "developer"]), _text)


_item = st.one_of(_user(), _reasoning(), _assistant(), _fc(), _fco(), _sys())


@given(items=st.lists(_item, min_size=1, max_size=14), instructions=st.none() | _text)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_item_sequences_convert_sanely(items, instructions):
    request = {"model": "m", "input": copy.deepcopy(items)}
    if instructions:
        request["instructions"] = instructions
    try:
        messages = responses_to_chat(request, ConvertOptions())["messages"]
    except InvalidRequestError:
        assert not any(
            i.get("role") == "user"
            or i.get("type") in ("function_call", "function_call_output")
            or i.get("role") == "assistant"
            or i.get("type") == "reasoning"
            for i in items
        )
        return
    roles = [m["role"] for m in messages]
    assert "developer" not in roles
    assert "system" not in roles[1:]
    assert (roles[0] == "system") == bool(instructions or any(i.get("role") in ("system", "developer") for i in items))
    # No user message is made from anything but a user item.
    assert roles.count("user") == sum(1 for i in items if i.get("role") == "user")
    assert roles.count("tool") == sum(1 for i in items if i.get("type") == "function_call_output")
    # Every call survives, in order, under its call_id.
    sent = [i["call_id"] for i in items if i.get("type") == "function_call"]
    got = [tc["id"] for m in messages for tc in m.get("tool_calls") or []]
    assert got == sent
    assert [tc["function"]["arguments"] for m in messages for tc in m.get("tool_calls") or []] == [
        i["arguments"] for i in items if i.get("type") == "function_call"
    ]
    # Consecutive assistant messages only where a model call ended (training fields on its last item).
    for a, b in zip(messages, messages[1:]):
        if a["role"] == b["role"] == "assistant":
            assert "generation_token_ids" in a
    # Reasoning is never lost.
    reasoning = "".join(m.get("reasoning_content", "") for m in messages)
    for i in items:
        if i.get("type") == "reasoning":
            text = (i.get("content") or i["summary"])[0]["text"]
            assert text in reasoning


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_keys = st.sampled_from(
    [
        "type",
        "role",
        "content",
        "call_id",
        "name",
        "arguments",
        "output",
        "summary",
        "id",
        "text",
        "prompt_token_ids",
        "generation_token_ids",
        "generation_log_probs",
    ]
)
_fuzz_item = st.dictionaries(
    _keys,
    _json
    | st.sampled_from(
        ["message", "user", "assistant", "reasoning", "function_call", "function_call_output", "system", "developer"]
    ),
    max_size=6,
)


@given(
    items=st.lists(_fuzz_item | _item, max_size=8),
    extra=st.dictionaries(
        st.sampled_from(
            [
                "instructions",
                "tools",
                "tool_choice",
                "text",
                "temperature",
                "max_output_tokens",
                "reasoning",
                "top_logprobs",
                "stream",
                "stop",
            ]
        ),
        _json,
        max_size=3,
    ),
)
@settings(max_examples=400, deadline=None)
def test_garbage_only_ever_raises_invalid_request(items, extra):
    try:
        responses_to_chat({"model": "m", "input": items, **extra}, ConvertOptions(reasoning_mode="think_tags"))
    except InvalidRequestError as e:
        assert e.status_code == 400 and e.message
