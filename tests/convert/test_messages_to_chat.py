"""Messages create request → Chat Completions request (``convert.messages_to_chat``)."""

from __future__ import annotations

import json

import pytest

from gymserve.convert import ConvertOptions
from gymserve.convert.messages_to_chat import messages_to_chat
from gymserve.errors import InvalidRequestError

TOKENS = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [4, 5], "generation_log_probs": [-0.5, -0.25]}
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _req(messages, **kw):
    return {"model": "m", "max_tokens": 16, "messages": messages, **kw}


def _error(body, **kw) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as exc:
        messages_to_chat(body, **kw)
    return exc.value


def test_a_tool_using_conversation_becomes_the_chat_conversation():
    body = _req(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
                **TOKENS,
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        tools=[WEATHER],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        stop_sequences=["END"],
        metadata={"user_id": "u-1"},
    )
    chat = messages_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
            **TOKENS,
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather of a city",
            },
        }
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["top_k"]) == (16, 0.5, 0.9, 20)
    assert chat["stop"] == ["END"] and chat["user"] == "u-1" and chat["model"] == "m"
    assert "stream" not in chat


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("think_tags", {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhi"}),
        ("reasoning", {"role": "assistant", "content": "hi", "reasoning": "hmm"}),
        ("drop", {"role": "assistant", "content": "hi"}),
    ],
)
def test_thinking_is_rendered_as_the_backend_wants(mode, expected):
    body = _req(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "hi"}],
            },
            {"role": "user", "content": "q2"},
        ]
    )
    assert messages_to_chat(body, ConvertOptions(reasoning_mode=mode))["messages"][1] == expected


def test_system_messages_in_the_list_join_the_one_system_message():
    body = _req(
        [
            {"role": "system", "content": "first"},
            {"role": "user", "content": "q"},
            {"role": "system", "content": [{"type": "text", "text": "second"}]},
            {"role": "user", "content": "q2"},
        ],
        system="top",
    )
    assert messages_to_chat(body)["messages"] == [
        {"role": "system", "content": "top\n\nfirst\n\nsecond"},
        {"role": "user", "content": "q\nq2"},  # consecutive user turns are one turn (Anthropic's rule)
    ]


def test_consecutive_assistant_messages_are_one_turn_unless_one_carries_training_fields():
    plain = _req(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "q2"},
        ]
    )
    assert messages_to_chat(plain)["messages"][1] == {"role": "assistant", "content": "a\n\nb"}
    split = _req(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", **TOKENS},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "q2"},
        ]
    )
    assert [m["content"] for m in messages_to_chat(split)["messages"]] == ["q", "a", "b", "q2"]


def test_training_fields_may_ride_on_a_content_block():
    body = _req(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a", **TOKENS}]},
            {"role": "user", "content": "q2"},
        ]
    )
    assert messages_to_chat(body)["messages"][1] == {"role": "assistant", "content": "a", **TOKENS}
    both = _req(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a", **TOKENS}], **TOKENS},
            {"role": "user", "content": "q2"},
        ]
    )
    assert _error(both).param == "messages[1].content[0].prompt_token_ids"


def test_broken_training_fields_are_named_where_they_are():
    body = _req(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", **{**TOKENS, "generation_log_probs": [-0.5]}},
            {"role": "user", "content": "q2"},
        ]
    )
    err = _error(body)
    assert err.param == "messages[1].generation_log_probs" and "must be equal" in err.message


def test_tool_results_keep_their_order_and_say_when_they_failed():
    body = _req(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "a", "name": "f", "input": {}},
                    {"type": "tool_use", "id": "b", "name": "f", "input": {"x": [1, "é"]}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "a",
                        "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                    },
                    {"type": "tool_result", "tool_use_id": "b", "content": "no such city", "is_error": True},
                    {"type": "tool_result", "tool_use_id": "c"},
                ],
            },
        ]
    )
    messages = messages_to_chat(body)["messages"]
    assert json.loads(messages[1]["tool_calls"][1]["function"]["arguments"]) == {"x": [1, "é"]}
    assert "é" in messages[1]["tool_calls"][1]["function"]["arguments"]  # not \u-escaped
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "a", "content": "one\ntwo"},
        {"role": "tool", "tool_call_id": "b", "content": "Error: no such city"},
        {"role": "tool", "tool_call_id": "c", "content": ""},
    ]


def test_redacted_thinking_is_accepted_and_dropped():
    body = _req(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "a"}],
            },
            {"role": "user", "content": "q2"},
        ]
    )
    assert messages_to_chat(body)["messages"][1] == {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice(choice, expected):
    chat = messages_to_chat(_req([{"role": "user", "content": "q"}], tools=[WEATHER], tool_choice=choice))
    assert chat["tool_choice"] == expected and "parallel_tool_calls" not in chat


def test_output_config_and_chat_template_kwargs():
    chat = messages_to_chat(
        _req(
            [{"role": "user", "content": "q"}],
            output_config={"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
            chat_template_kwargs={"enable_thinking": False},
            thinking={"type": "enabled", "budget_tokens": 2048},
            cache_control={"type": "ephemeral"},
            service_tier="auto",
        )
    )
    assert chat["reasoning_effort"] == "low"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": {"type": "object"}},
    }
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert "thinking" not in chat and "cache_control" not in chat and "service_tier" not in chat


def test_unknown_fields_are_ignored_as_vllm_does():
    """New SDK releases and harness betas (``context_management``...) add fields faster than a server
    can list them; the OpenAI APIs' fields are refused (above), anything else is left out."""
    chat = messages_to_chat(_req([{"role": "user", "content": "q"}], context_management={"edits": []}, frobnicate=1))
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 16}


def test_count_only_needs_no_max_tokens_and_takes_no_sampling():
    chat = messages_to_chat({"model": "m", "messages": [{"role": "user", "content": "q"}]}, count_only=True)
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "q"}]}


def test_max_tokens_field_follows_the_backend():
    chat = messages_to_chat(
        _req([{"role": "user", "content": "q"}]), ConvertOptions(max_tokens_field="max_completion_tokens")
    )
    assert chat["max_completion_tokens"] == 16 and "max_tokens" not in chat


def test_nulls_at_the_top_mean_absent():
    chat = messages_to_chat(_req([{"role": "user", "content": "q"}], temperature=None, tools=None, system=None))
    assert "temperature" not in chat and "tools" not in chat and chat["messages"] == [{"role": "user", "content": "q"}]


@pytest.mark.parametrize(
    "change, param, words",
    [
        ({"max_tokens": None}, "max_tokens", "max_tokens is required"),
        ({"max_tokens": 0}, "max_tokens", "out of range"),
        ({"max_tokens": "10"}, "max_tokens", "must be an integer"),
        ({"temperature": 1.5}, "temperature", "out of range"),
        ({"top_k": -1}, "top_k", "out of range"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"stop_sequences": "END"}, "stop_sequences", "list of strings"),
        ({"max_completion_tokens": 5}, "max_completion_tokens", "use max_tokens"),
        ({"stop": ["x"]}, "stop", "use stop_sequences"),
        ({"input": "hi"}, "input", "use messages"),
        ({"container": "c-1"}, "container", "containers"),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers", "MCP connector"),
        ({"tool_choice": "auto"}, "tool_choice", "not a string"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name", "name is required"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "server tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].input_schema", "OpenAI tool"),
        ({"tools": [{"name": "f", "input_schema": "city: str"}]}, "tools[0].input_schema", "JSON Schema object"),
        ({"tools": [{"input_schema": {}}]}, "tools[0].name", "name is required"),
        ({"metadata": {"user_id": 5}}, "metadata.user_id", "must be a string"),
        ({"output_config": {"format": {"type": "text"}}}, "output_config.format", "json_schema"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"model": 5}, "model", "must be a string"),
        ({"system": 5}, "system", "string or a list of text blocks"),
    ],
)
def test_bad_top_level_fields_are_named(change, param, words):
    body = {k: v for k, v in {**_req([{"role": "user", "content": "q"}]), **change}.items()}
    if change.get("max_tokens", 1) is None:
        body.pop("max_tokens")
    err = _error(body)
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize(
    "messages, param, words",
    [
        ([{"role": "tool", "content": "x"}], "messages[0].role", "tool_result blocks"),
        ([{"content": "x"}], "messages[0].role", "is required"),
        ([{"role": "user"}], "messages[0].content", "is required"),
        ([{"role": "user", "content": 5}], "messages[0].content", "string or a list"),
        (
            [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}],
            "messages[0].content[0].type",
            "image blocks are not supported",
        ),
        (
            [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            "messages[0].content[0].type",
            "document blocks",
        ),
        (
            [{"role": "user", "content": [{"type": "web_search_tool_result", "tool_use_id": "x", "content": []}]}],
            "messages[0].content[0].type",
            "server tools",
        ),
        (
            [{"role": "user", "content": [{"type": "hologram"}]}],
            "messages[0].content[0].type",
            "unknown content block type",
        ),
        ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0].type", "is required"),
        ([{"role": "user", "content": ["bare"]}], "messages[0].content[0]", "content block object"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "messages[0].content[0].text",
            "must be a string",
        ),
        (
            [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
            "messages[0].content[0].type",
            "assistant message",
        ),
        ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id", "is required"),
        (
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": "yes"}]}],
            "messages[0].content[0].is_error",
            "boolean",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image", "source": {}}]}
                    ],
                }
            ],
            "messages[0].content[0].content[0].type",
            "image blocks",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]},
                {"role": "user", "content": "q"},
            ],
            "messages[1].content[0].input",
            "must be an object",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]},
                {"role": "user", "content": "q"},
            ],
            "messages[1].content[0].type",
            "user message",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "thinking"}]},
                {"role": "user", "content": "q"},
            ],
            "messages[1].content[0].thinking",
            "must be a string",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is ("}],
            "messages[1]",
            "prefill",
        ),
    ],
)
def test_bad_messages_are_named_in_the_callers_words(messages, param, words):
    err = _error(_req(messages))
    assert err.param == param and words in err.message, err.message
