"""Responses create request → Chat Completions request: the rules, and bad input."""

from __future__ import annotations

import pytest

from gymserve.convert import ConvertOptions, responses_to_chat
from gymserve.errors import InvalidRequestError

OPTS = ConvertOptions()
TOKENS = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [7, 8], "generation_log_probs": [-0.5, -0.25]}


def convert(body, **options):
    return responses_to_chat({"model": "m", **body}, ConvertOptions(**options))


def test_string_input_is_one_user_message():
    assert convert({"input": "hi"}) == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_items_without_type_are_messages():
    chat = convert({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    assert chat["messages"] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_user_content_parts():
    chat = convert(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
                    ],
                }
            ]
        }
    )
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
    ]
    text_only = convert(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}
            ]
        }
    )
    assert text_only["messages"][0]["content"] == "a\nb"


def test_assistant_output_text_parts_without_id_or_annotations_are_accepted():
    # NeMo Gym 0.7.0 answers 422 here; the OpenAI API accepts it.
    chat = convert(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "ans"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            ]
        }
    )
    assert chat["messages"][1] == {"role": "assistant", "content": "ans\n\nno"}


@pytest.mark.parametrize("part_type", ["input_file", "input_audio"])
def test_file_and_audio_parts_are_refused_by_name(part_type):
    with pytest.raises(InvalidRequestError) as e:
        convert({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": part_type}]}]})
    assert e.value.param == "input[0].content[1].type" and part_type in e.value.message


def test_system_and_developer_anywhere_join_the_leading_system_message():
    chat = convert(
        {
            "instructions": "I",
            "input": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "u"},
                {"role": "developer", "content": [{"type": "input_text", "text": "D"}]},
            ],
        }
    )
    assert chat["messages"] == [{"role": "system", "content": "I\n\nS\n\nD"}, {"role": "user", "content": "u"}]


def test_one_model_turn_is_one_assistant_message_with_parallel_calls():
    chat = convert(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "summary only"}]},
                {
                    "type": "reasoning",
                    "id": "rs_2",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "r2"}],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
                {"type": "function_call", "id": "fc_a", "call_id": "call_a", "name": "f", "arguments": '{"x":1}'},
                {"type": "function_call", "id": "fc_b", "call_id": "call_b", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_a", "output": "A"},
                {
                    "type": "function_call_output",
                    "call_id": "call_b",
                    "output": [{"type": "input_text", "text": "B1"}, {"type": "input_text", "text": "B2"}],
                },
            ]
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning_content": "summary only\n\nr2",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
                {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "A"},
        {"role": "tool", "tool_call_id": "call_b", "content": "B1\nB2"},
    ]


def test_think_tags_wrap_reasoning_before_content():
    chat = convert(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
                {"role": "assistant", "content": "answer"},
            ]
        },
        reasoning_mode="think_tags",
    )
    assert chat["messages"][1] == {"role": "assistant", "content": "<think>\nr\n</think>\n\nanswer"}


def test_encrypted_only_reasoning_is_dropped():
    chat = convert(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "gAAA"},
                {"role": "assistant", "content": "a"},
            ]
        }
    )
    assert chat["messages"][1] == {"role": "assistant", "content": "a"}


def test_training_fields_ride_on_the_rebuilt_assistant_message_and_end_the_model_call():
    chat = convert(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", **TOKENS},
                {"role": "assistant", "content": "second call, no output in between"},
            ]
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "r",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        **TOKENS,
    }
    assert chat["messages"][2] == {"role": "assistant", "content": "second call, no output in between"}


def test_sampling_params_and_extras():
    chat = convert(
        {
            "input": "hi",
            "max_output_tokens": 64,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_logprobs": 2,
            "stop": ["\n"],
            "seed": 7,
            "user": "u",
            "metadata": {"k": "v"},
            "stream": True,
            "parallel_tool_calls": False,
            "reasoning": {"effort": "low"},
            "chat_template_kwargs": {"enable_thinking": False},
            "store": True,
            "include": [],
        }
    )
    assert {k: v for k, v in chat.items() if k != "messages"} == {
        "model": "m",
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ["\n"],
        "seed": 7,
        "user": "u",
        "metadata": {"k": "v"},
        "stream": True,
        "stream_options": {"include_usage": True},
        "parallel_tool_calls": False,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert (
        convert({"input": "hi", "max_output_tokens": 5}, max_tokens_field="max_completion_tokens")[
            "max_completion_tokens"
        ]
        == 5
    )


def test_function_tools_and_tool_choice():
    chat = convert(
        {
            "input": "hi",
            "tool_choice": {"type": "function", "name": "f"},
            "tools": [
                {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
                {"type": "function", "name": "g"},
            ],
        }
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
        },
        {"type": "function", "function": {"name": "g"}},
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    for choice in ("auto", "none", "required"):
        assert convert({"input": "hi", "tool_choice": choice})["tool_choice"] == choice


@pytest.mark.parametrize(
    "tool_type",
    [
        "web_search",
        "web_search_preview",
        "file_search",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "custom",
    ],
)
def test_hosted_tools_are_refused_by_name(tool_type):
    with pytest.raises(InvalidRequestError) as e:
        convert({"input": "hi", "tools": [{"type": "function", "name": "f"}, {"type": tool_type}]})
    assert e.value.param == "tools[1].type" and tool_type in e.value.message
    assert e.value.status_code == 400


BAD = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": ["text"]}, "input[0]"),
    ({"input": [{"content": "x"}]}, "input[0].type"),
    ({"input": [{"type": "banana"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "input[0].content[0].text"),
    (
        {"input": [{"role": "user", "content": "q"}, {"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[1].call_id",
    ),
    (
        {"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c", "arguments": "{}"}]},
        "input[1].name",
    ),
    (
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": 3},
            ]
        },
        "input[1].arguments",
    ),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
        "input[0].output[0].type",
    ),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": ["x"]}]}, "input[0].output[0]"),
    (
        {"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "u"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary"),
    ({"input": [{"role": "assistant", "content": "a", "prompt_token_ids": [1]}]}, "input[0].generation_token_ids"),
    (
        {"input": [{"role": "assistant", "content": "a", **TOKENS, "generation_log_probs": [-1.0]}]},
        "input[0].generation_log_probs",
    ),
    ({"input": "hi", "instructions": 3}, "instructions"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "max_output_tokens": 1.5}, "max_output_tokens"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "tools": {"type": "function"}}, "tools"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_names_the_field(body, param):
    with pytest.raises(InvalidRequestError) as e:
        responses_to_chat({"model": "m", **body}, OPTS)
    assert e.value.param == param, e.value.message
    assert e.value.to_dict()["error"]["type"] == "invalid_request_error"


def test_non_dict_request():
    with pytest.raises(InvalidRequestError):
        responses_to_chat(["not", "a", "dict"], OPTS)  # type: ignore[arg-type]


def test_request_is_not_mutated():
    import copy

    body = {
        "model": "m",
        "instructions": "i",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}],
    }
    before = copy.deepcopy(body)
    responses_to_chat(body, OPTS)
    assert body == before


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens", r"max_output_tokens=0 is out of range: it must be at least 1"),
        ({"max_output_tokens": -1}, "max_output_tokens", "out of range"),
        ({"top_logprobs": 21}, "top_logprobs", r"top_logprobs=21 is out of range: it must be from 0 to 20"),
        ({"top_p": 1.5}, "top_p", r"top_p=1.5 is out of range: it must be from 0 to 1"),
        ({"temperature": -0.5}, "temperature", "out of range"),
        (
            {"max_output_tokens": "4"},
            "max_output_tokens",
            r"max_output_tokens must be an integer, got a string \('4'\)",
        ),
        ({"temperature": True}, "temperature", "temperature must be a number, got a boolean"),
        ({"include": "x"}, "include", "list of strings"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]", "generation_log_probs"),
        ({"include": ["reasoning.encrypted_content", "nope"]}, "include[1]", "not a known include value"),
        ({"background": True}, "background", "stores no responses"),
    ],
)
def test_responses_fields_gymserve_cannot_honour_are_named(extra, param, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        responses_to_chat({"model": "m", "input": "hi", **extra})
    assert info.value.param == param


def test_include_values_that_add_nothing_are_accepted():
    chat = responses_to_chat(
        {"model": "m", "input": "hi", "include": ["reasoning.encrypted_content"], "background": False}
    )
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "include" not in chat


# ------------------------------------------------------------------------------ nulls, system-only input
def test_explicit_null_means_absent():
    """NeMo Gym's task rows send ``"model": null``; every optional field's null is its absence."""
    nulls = {
        "model": None,
        "instructions": None,
        "temperature": None,
        "max_output_tokens": None,
        "tools": None,
        "tool_choice": None,
        "text": None,
        "reasoning": None,
        "stream": None,
        "metadata": None,
    }
    assert responses_to_chat({"input": "hi", **nulls}) == {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "body",
    [
        {"input": [{"role": "system", "content": "Say hello."}]},
        {"input": [{"role": "developer", "content": [{"type": "input_text", "text": "Say hello."}]}]},
        {"instructions": "Say hello.", "input": []},
    ],
)
def test_a_system_prompt_alone_is_a_conversation(body):
    assert responses_to_chat(body)["messages"] == [{"role": "system", "content": "Say hello."}]


def test_developer_kept_alone_is_a_conversation():
    chat = responses_to_chat(
        {"input": [{"role": "developer", "content": "Say hello."}]}, ConvertOptions(developer_role="keep")
    )
    assert chat["messages"] == [{"role": "developer", "content": "Say hello."}]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "input is required: a string, or a list of input items"),
        ({"input": None}, "input is required"),
        ({"input": []}, "input is empty: give a string or at least one message item"),
        ({"input": [{"role": "system", "content": ""}]}, "input holds no message text"),
        ({"input": [{"role": "user"}]}, "input[0].content is required: a string or a list of content parts"),
        (
            {"input": [{"role": "user", "content": 3}]},
            "input[0].content must be a string or a list of content parts, got a number",
        ),
        ({"input": ["hi"]}, "input[0] must be an input item object, got a string"),
        (
            {"input": [{"type": "message", "content": "x"}]},
            "input[0].role is required: use user, assistant, system or developer",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role 'robot' is not a role: use user, assistant"),
        ({"input": "hi", "model": 7}, "model must be a string, got a number"),
    ],
)
def test_error_wording_says_what_is_wrong(body, message):
    with pytest.raises(InvalidRequestError) as e:
        responses_to_chat(body)
    assert e.value.message.startswith(message), e.value.message


# ------------------------------------------------------------------------------ tools, the same on both routes
@pytest.mark.parametrize(
    ("tool", "param", "message"),
    [
        (
            {"type": "function", "name": "get_weather", "parameters": "city: string"},
            "tools[0].parameters",
            (
                'tools[0].parameters must be a JSON Schema object, got a string, e.g. {"type": "object", '
                '"properties": {"city": {"type": "string"}}}'
            ),
        ),
        (
            {"type": "function", "name": ""},
            "tools[0].name",
            "tools[0].name is required (a non-empty string), got an empty string",
        ),
        (
            {"type": "function", "name": 3},
            "tools[0].name",
            "tools[0].name is required (a non-empty string), got a number",
        ),
        (
            {"type": "function", "name": "f", "description": ["d"]},
            "tools[0].description",
            "tools[0].description must be a string, got an array",
        ),
        (
            {"type": "function", "name": "f", "strict": "yes"},
            "tools[0].strict",
            "tools[0].strict must be a boolean, got a string",
        ),
        (
            {"type": "function", "function": {"name": "f"}},
            "tools[0].name",
            (
                "tools[0].name is required (this looks like a Chat Completions tool; the Responses API puts name, "
                "description and parameters on the tool itself"
            ),
        ),
        ("f", "tools[0]", "tools[0] must be an object, got a string"),
    ],
)
def test_bad_function_tools_are_named(tool, param, message):
    with pytest.raises(InvalidRequestError) as e:
        responses_to_chat({"input": "hi", "tools": [tool]})
    assert e.value.param == param and e.value.message.startswith(message), e.value.message


def test_one_tool_checker_for_both_shapes():
    """The chat route's checker says the same words as the converter's, only the path differs."""
    from gymserve.convert.request_checks import chat_tools

    flat = {"type": "function", "name": "get_weather", "parameters": "city: string"}
    nested = {"type": "function", "function": {"name": "get_weather", "parameters": "city: string"}}
    with pytest.raises(InvalidRequestError) as responses_error:
        responses_to_chat({"input": "hi", "tools": [flat]})
    with pytest.raises(InvalidRequestError) as chat_error:
        chat_tools([nested], functions_only=True)
    assert chat_error.value.param == "tools[0].function.parameters"
    assert chat_error.value.message == responses_error.value.message.replace("tools[0].", "tools[0].function.")
