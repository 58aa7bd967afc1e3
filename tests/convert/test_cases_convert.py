"""The public cases of the convert categories (tests/data/cases/public.jsonl), as concrete checks."""

from __future__ import annotations

import copy
import json
from typing import Any

import jinja2
import pytest

from gymserve.convert import (
    ConvertOptions,
    ResponseStreamBuilder,
    chat_to_response,
    context_exceeded_chat_completion,
    context_exceeded_response,
    responses_to_chat,
)
from helpers.spec import (
    assert_subset,
    assert_valid_chat_completion,
    assert_valid_event,
    assert_valid_response,
    load_cases,
)

CASES = load_cases("responses_to_chat", "chat_to_responses", "context_length", "streaming")


def full_completion(partial: dict[str, Any], model: str = "MODEL") -> dict[str, Any]:
    """A case's abbreviated chat completion, completed with the keys every real one has."""
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model, **partial}


def test_cases_are_present():
    assert {"RC-01", "RC-05", "RC-06", "CR-01", "CR-02", "CR-04", "CL-01", "ST-01"} <= set(CASES)


# -- RC: Responses request → chat request ------------------------------------------------------


def test_rc01_reasoning_rides_on_the_tool_calling_assistant_message():
    case = CASES["RC-01"]
    chat = responses_to_chat(case["input"]["body"], ConvertOptions(reasoning_mode="reasoning_content"))
    assert chat["messages"] == case["expected"]["chat_messages"]
    assert len(chat["messages"]) == 3
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool"]
    assistant = chat["messages"][1]
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert assistant["reasoning_content"] == "I should call get_weather for Paris."


def test_rc01_newer_vllm_field_name():
    case = CASES["RC-01"]
    chat = responses_to_chat(case["input"]["body"], ConvertOptions(reasoning_mode="reasoning"))
    assistant = chat["messages"][1]
    assert assistant["reasoning"] == "I should call get_weather for Paris."
    assert "reasoning_content" not in assistant
    assert assistant["tool_calls"][0]["id"] == "call_1"


def test_rc01_think_tags_and_drop():
    body = CASES["RC-01"]["input"]["body"]
    tags = responses_to_chat(body, ConvertOptions(reasoning_mode="think_tags"))["messages"][1]
    assert tags["content"] == "<think>\nI should call get_weather for Paris.\n</think>\n\n"
    dropped = responses_to_chat(body, ConvertOptions(reasoning_mode="drop"))["messages"][1]
    assert dropped["content"] is None and "reasoning_content" not in dropped and "reasoning" not in dropped


# A ChatML template like Qwen's, strict the way HF templates are: only the roles it knows, and a
# system message only at index 0.
_QWEN_LIKE = jinja2.Environment().from_string(
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise('Unexpected message role') }}{% endif %}"
    "{% if m.role == 'system' and not loop.first %}{{ raise('System message must be first') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


def _render(messages):
    def fail(msg):
        raise ValueError(msg)

    return _QWEN_LIKE.render(messages=messages, **{"raise": fail})


def test_rc05_one_leading_system_message():
    case = CASES["RC-05"]
    chat = responses_to_chat(case["input"]["body"], ConvertOptions())
    assert chat["messages"] == case["expected"]["chat_messages"]
    roles = [m["role"] for m in chat["messages"]]
    assert roles.count("system") == 1 and roles[0] == "system" and "developer" not in roles
    system = chat["messages"][0]["content"]
    assert system.index("You are terse.") < system.index("Reply in French.")
    prompt = _render(chat["messages"])
    assert "Reply in French." in prompt and "You are terse." in prompt
    with pytest.raises(ValueError, match="Unexpected message role"):  # the template is that strict
        _render([{"role": "developer", "content": "Reply in French."}])


def test_rc05_developer_kept_for_openai():
    chat = responses_to_chat(CASES["RC-05"]["input"]["body"], ConvertOptions(developer_role="keep"))
    assert chat["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Reply in French."},
        {"role": "user", "content": "Hello"},
    ]


def test_rc06_json_schema_becomes_response_format():
    case = CASES["RC-06"]
    chat = responses_to_chat(case["input"]["body"], ConvertOptions())
    assert chat["response_format"] == case["expected"]["chat_request_fields"]["response_format"]
    assert chat["messages"] == [{"role": "user", "content": "Return the literal text NOT_JSON."}]


@pytest.mark.parametrize("variant", ["json_object", "plain"])
def test_rc06_variants(variant):
    case = CASES["RC-06"]
    body = {**case["input"]["body"], **case["input"]["variants"][variant]}
    chat = responses_to_chat(body, ConvertOptions())
    expected = case["expected"]["variants"][variant]
    if variant == "plain":
        assert "response_format" not in chat
    else:
        assert chat["response_format"] == expected["response_format"]


@pytest.mark.parametrize("variant", ["", "json_object", "plain"])
def test_rc06_response_echoes_text_format(variant):
    case = CASES["RC-06"]
    body = {**case["input"]["body"], **(case["input"]["variants"][variant] if variant else {})}
    completion = full_completion(
        {
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": '{"ok": true}'}}
            ]
        }
    )
    response = chat_to_response(completion, body)
    assert_valid_response(response)
    for key, value in body["text"]["format"].items():
        assert response["text"]["format"][key] == value


# -- CR: chat completion → Response ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["new_field", "old_field", "both_fields"])
def test_cr01_reasoning_field_names(variant):
    case = CASES["CR-01"]
    completion = full_completion(case["input"]["backend_chat_responses"][variant])
    response = chat_to_response(completion, {"model": "MODEL", "input": "2+2?"})
    assert_valid_response(response)
    assert_subset(case["expected"]["responses_output_for_each_variant"], response["output"])
    assert [item["type"] for item in response["output"]].count("reasoning") == 1
    assert response["output"][0]["id"].startswith("rs_") and response["output"][1]["id"].startswith("msg_")


@pytest.mark.parametrize("variant", ["length_with_text", "length_reasoning_only", "content_filter", "tool_calls"])
def test_cr02_finish_reason_sets_status(variant):
    case = CASES["CR-02"]
    completion = full_completion(case["input"]["backend_chat_responses"][variant])
    response = chat_to_response(completion, {"model": "MODEL", "input": "primes?"})
    assert_valid_response(response)
    expected = {k: v for k, v in case["expected"][variant].items() if k != "note"}
    assert_subset(expected, response)
    if variant == "length_reasoning_only":
        assert [item["type"] for item in response["output"]] == ["reasoning"]
    if variant == "content_filter":
        assert response["output"] == []  # empty content: no empty message item
    if variant == "tool_calls":
        assert response["incomplete_details"] is None
        assert response["output"][0]["call_id"] == "call_1"


def test_cr04_arguments_are_always_strings():
    case = CASES["CR-04"]
    completion = full_completion(case["input"]["backend_chat_response"])
    response = chat_to_response(completion, {"model": "MODEL", "input": "weather and time"})
    assert_valid_response(response)
    assert_subset(case["expected"]["responses_output"], response["output"])
    original = completion["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    for item in response["output"]:
        assert isinstance(item["arguments"], str)
    assert json.loads(response["output"][0]["arguments"]) == original
    assert response["output"][1]["arguments"] == "{}"


# -- CL: context overflow ----------------------------------------------------------------------


def test_cl01_responses_overflow_is_an_empty_incomplete_response():
    expected = CASES["CL-01"]["expected"]["responses"]
    response = context_exceeded_response({"model": "MODEL", "input": "long history", "max_output_tokens": 100})
    assert_valid_response(response)
    assert response["status"] == expected["status"]
    assert response["incomplete_details"] == expected["incomplete_details"]
    assert response["output"] == expected["output"] == []
    assert response["usage"]["output_tokens"] == 0
    assert response["model"] == "MODEL"
    assert not any(f in response for f in ("prompt_token_ids", "generation_token_ids"))


def test_cl01_chat_overflow_is_a_length_terminated_empty_choice():
    expected = CASES["CL-01"]["expected"]["chat_completions"]
    completion = context_exceeded_chat_completion({"model": "MODEL", "messages": []}, "MODEL")
    assert_valid_chat_completion(completion)
    assert_subset(expected["choices"], completion["choices"])
    assert completion["model"] == "MODEL"


# -- ST: streaming -----------------------------------------------------------------------------


def test_st01_full_event_lifecycle():
    case = CASES["ST-01"]
    builder = ResponseStreamBuilder(case["input"]["body"])
    events = builder.start()
    for chunk in case["input"]["backend_chat_chunks"]:
        events += builder.feed(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "MODEL",
                "choices": [{"index": 0, **copy.deepcopy(chunk)}],
            }
        )
    events += builder.finish()
    for event in events:
        assert_valid_event(event)
    assert [e["type"] for e in events] == case["expected"]["event_types_in_order"]
    assert [e["sequence_number"] for e in events] == list(range(10))
    item_events = events[2:9]
    item_id = events[2]["item"]["id"]
    assert all(e.get("item_id", e.get("item", {}).get("id")) == item_id for e in item_events)
    assert all(e["output_index"] == 0 for e in item_events)
    assert all(e["content_index"] == 0 for e in item_events if "content_index" in e or "part" in e or "delta" in e)
    assert events[2]["item"]["type"] == "message" and events[2]["item"]["content"] == []
    assert events[3]["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    assert [e["delta"] for e in events[4:6]] == ["Hel", "lo"]
    assert events[6]["text"] == "Hello"
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][0]["id"] == item_id


def test_st01_bare_choice_chunks_are_accepted():
    case = CASES["ST-01"]
    builder = ResponseStreamBuilder(case["input"]["body"])
    events = builder.start()
    for chunk in case["input"]["backend_chat_chunks"]:
        events += builder.feed(copy.deepcopy(chunk))
    events += builder.finish()
    assert [e["type"] for e in events] == case["expected"]["event_types_in_order"]
    assert events[-1]["response"]["model"] == "MODEL"
