"""Chat completion → Response: items, status, usage, echo, training fields, validity."""

from __future__ import annotations

import pytest

from gymserve.convert import chat_to_response, split_think
from gymserve.errors import InvalidRequestError, UpstreamError
from helpers.spec import assert_valid_response

TOKENS = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [7, 8, 9], "generation_log_probs": [-0.1, -0.2, -0.3]}
REQUEST = {"model": "policy", "input": "q"}


def completion(message, finish_reason="stop", usage=None, **extra):
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "served-name",
        "choices": [{"index": 0, "finish_reason": finish_reason, "message": {"role": "assistant", **message}}],
        "usage": usage,
        **extra,
    }


def convert(message, request=REQUEST, **kw):
    response = chat_to_response(completion(message, **kw), request)
    assert_valid_response(response)
    return response


def test_reasoning_text_and_calls_in_order_with_tokens_on_last_item():
    response = convert(
        {
            "content": "Let me check.",
            "reasoning_content": "think",
            **TOKENS,
            "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        finish_reason="tool_calls",
    )
    out = response["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "think"}] and out[0]["summary"] == []
    assert out[1]["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]
    assert out[2]["call_id"] == "call_9" and out[2]["id"].startswith("fc_") and out[2]["arguments"] == '{"a": 1}'
    for field, value in TOKENS.items():
        assert out[2][field] == value
        assert field not in out[0] and field not in out[1] and field not in response
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["id"].startswith("resp_") and response["object"] == "response"


def test_tokens_get_an_empty_message_item_when_output_is_empty():
    """A call with no visible output is still a turn: an empty message item carries its tokens."""
    response = convert({"content": "", **TOKENS}, finish_reason="length")
    [item] = response["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "" and item["status"] == "incomplete"
    assert all(item[f] == v for f, v in TOKENS.items())


def test_every_think_block_becomes_reasoning():
    response = convert({"content": "<think>\n first \n</think>\n\nAnswer<think>second</think>  done"})
    out = response["output"]
    assert [(i["type"], (i["content"][0]["text"])) for i in out] == [
        ("reasoning", "first"),
        ("message", "Answer"),
        ("reasoning", "second"),
        ("message", "done"),
    ]


def test_think_block_and_reasoning_field_together():
    out = convert({"content": "<think>r</think>\n\nA", "reasoning": "field"})["output"]
    assert [i["content"][0]["text"] for i in out] == ["field", "r", "A"]


def test_unclosed_think_is_truncated_reasoning():
    response = convert({"content": "<think>\nstill thinking"}, finish_reason="length")
    assert [i["type"] for i in response["output"]] == ["reasoning"]
    assert response["output"][0]["content"][0]["text"] == "still thinking"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(
    "content,expected",
    [
        ("plain", [("text", "plain")]),
        ("  lead and trail  ", [("text", "  lead and trail  ")]),
        ("<think></think>\n\nA", [("text", "A")]),
        ("A<think></think>B", [("text", "AB")]),
        ("<think>x</think>", [("reasoning", "x")]),
        ("", []),
        ("   ", []),
        ("a < b <thinking>", [("text", "a < b <thinking>")]),
    ],
)
def test_split_think(content, expected):
    assert split_think(content) == expected


def test_split_think_partial_is_a_prefix_of_final():
    content = "<think>\nabc\n</think>\n\nHello world <think>x</think> end  "
    final = split_think(content)
    for n in range(len(content) + 1):
        partial = split_think(content[:n], final=False)
        assert len(partial) <= len(final)
        for i, (kind, text) in enumerate(partial):
            assert kind == final[i][0] and final[i][1].startswith(text)
            if i < len(partial) - 1:
                assert text == final[i][1]


def test_length_marks_only_the_last_item_incomplete():
    out = convert({"content": "<think>r</think>partial answer"}, finish_reason="length")["output"]
    assert "status" not in out[0] and out[1]["status"] == "incomplete"
    calls = convert(
        {
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": '{"x": '}},
            ]
        },
        finish_reason="length",
    )["output"]
    assert [c["status"] for c in calls] == ["completed", "incomplete"]


def test_missing_call_id_gets_a_fresh_one_and_name_kept():
    out = convert(
        {"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": None}}]}, finish_reason="tool_calls"
    )["output"]
    assert out[0]["call_id"].startswith("call_") and out[0]["name"] == "f" and out[0]["arguments"] == "{}"


def test_refusal_becomes_a_refusal_part():
    out = convert({"content": None, "refusal": "I can't"})["output"]
    assert out[0]["content"] == [{"type": "refusal", "refusal": "I can't"}]


def test_usage_mapping():
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    assert convert({"content": "a"}, usage=usage)["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 15,
    }
    assert convert({"content": "a"}, usage={"prompt_tokens": 2, "completion_tokens": 1})["usage"][
        "input_tokens_details"
    ] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert convert({"content": "a"})["usage"] is None


def test_request_params_are_echoed():
    request = {
        "model": "policy",
        "input": "q",
        "instructions": "be brief",
        "max_output_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.8,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "high"},
        "metadata": {"run": "7"},
        "top_logprobs": 3,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
    }
    response = chat_to_response(completion({"content": "a"}), request, response_id="resp_fixed", created_at=123.9)
    assert_valid_response(response)
    expected = {
        "id": "resp_fixed",
        "created_at": 123,
        "model": "served-name",
        "instructions": "be brief",
        "max_output_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.8,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "high", "summary": None},
        "metadata": {"run": "7"},
        "top_logprobs": 3,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "text": {"format": {"type": "text"}},
        "error": None,
        "tools": [
            {
                "type": "function",
                "name": "f",
                "description": None,
                "parameters": {"type": "object", "properties": {}},
                "strict": None,
            }
        ],
    }
    assert {k: response[k] for k in expected} == expected
    defaults = chat_to_response(completion({"content": "a"}), {"input": "q"})
    assert (defaults["tool_choice"], defaults["parallel_tool_calls"], defaults["tools"]) == ("auto", True, [])
    assert (defaults["temperature"], defaults["top_p"], defaults["metadata"]) == (1.0, 1.0, {})


def test_item_ids_are_used_in_order():
    response = chat_to_response(completion({"content": "<think>r</think>a"}), REQUEST, item_ids=["rs_x", "msg_y"])
    assert [i["id"] for i in response["output"]] == ["rs_x", "msg_y"]


def test_input_is_not_mutated():
    import copy

    c = completion({"content": "a", **TOKENS})
    before = copy.deepcopy(c)
    chat_to_response(c, REQUEST)
    assert c == before


@pytest.mark.parametrize("bad", [{}, {"choices": []}, {"choices": ["x"]}, None])
def test_completion_without_choices_is_an_upstream_error(bad):
    with pytest.raises(UpstreamError):
        chat_to_response(bad, REQUEST)


def test_inconsistent_training_fields_are_refused():
    with pytest.raises(InvalidRequestError) as e:
        chat_to_response(completion({"content": "a", "prompt_token_ids": [1]}), REQUEST)
    assert e.value.param == "generation_token_ids"


def test_top_level_vllm_style_tokens_are_picked_up():
    response = chat_to_response(completion({"content": "a"}, **TOKENS), REQUEST)
    assert response["output"][0]["generation_token_ids"] == TOKENS["generation_token_ids"]
