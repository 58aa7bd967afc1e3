"""The public cases of the parsing categories (tests/data/cases/public.jsonl), as concrete checks.

The cases state expectations as Responses output items; ``as_output_items`` maps a ParsedOutput to
that shape the way the convert layer does (reasoning item, message, function calls, in order).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gymserve.parsers import (
    ParsedOutput,
    StreamingParser,
    get_reasoning_parser,
    get_tool_call_parser,
    parse_output,
)
from helpers.spec import assert_subset, load_cases

CASES = load_cases("reasoning_parsing", "tool_call_parsing")


def tools(*names: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


def as_output_items(parsed: ParsedOutput) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        items.append({"type": "reasoning", "content": [{"type": "reasoning_text", "text": parsed.reasoning}]})
    if parsed.content is not None:
        items.append({"type": "message", "content": [{"type": "output_text", "text": parsed.content}]})
    for call in parsed.tool_calls:
        items.append(
            {
                "type": "function_call",
                "name": call.name,
                "arguments": call.arguments,
                "arguments_parsed": json.loads(call.arguments),
            }
        )
    return items


def all_texts(items: list[dict[str, Any]]) -> list[str]:
    return [part["text"] for item in items for part in item.get("content", [])]


def test_cases_are_present():
    assert {"RP-01", "RP-04", "TP-02", "TP-04"} <= set(CASES)


@pytest.mark.parametrize("reasoning_name", ["qwen3", "deepseek_r1"])
def test_rp01_prefilled_think_uses_the_real_prompt_tail(reasoning_name):
    case = CASES["RP-01"]
    inp = case["input"]
    parsed = parse_output(
        inp["raw_generation_text"],
        prompt_tail=inp["prompt_text_tail"],
        finish_reason=inp["finish_reason"],
        reasoning_parser=get_reasoning_parser(reasoning_name),
    )
    items = as_output_items(parsed)
    assert_subset(case["expected"]["output"], items)
    # "no '</think>' or '<think>' substring in any output text"
    assert not any("<think>" in t or "</think>" in t for t in all_texts(items))
    # "whitespace adjacent to the tags is stripped"
    assert all(t == t.strip() for t in all_texts(items))
    # "decision is based on the actual prompt tail": the same text after a prompt that does not
    # open <think> (and did not say so) has no span to close, so no reasoning.
    no_think = parse_output(
        "The answer is 4.", prompt_tail="<|im_start|>assistant\n", reasoning_parser=get_reasoning_parser(reasoning_name)
    )
    assert no_think.reasoning is None and no_think.content == "The answer is 4."


@pytest.mark.parametrize("reasoning_name", ["qwen3", "deepseek_r1"])
def test_rp04_unclosed_span_depends_on_finish_reason(reasoning_name):
    case = CASES["RP-04"]
    inp = case["input"]
    parser = get_reasoning_parser(reasoning_name)
    stopped = parse_output(
        inp["raw_generation_text"],
        prompt_tail=inp["prompt_text_tail"],
        finish_reason=inp["finish_reason"],
        reasoning_parser=parser,
    )
    assert_subset(case["expected"]["output"], as_output_items(stopped))
    assert stopped.reasoning_incomplete is False
    # "with finish_reason=length keep it as reasoning"
    cut = parse_output(
        inp["raw_generation_text"],
        prompt_tail=inp["prompt_text_tail"],
        finish_reason="length",
        reasoning_parser=parser,
    )
    assert cut.reasoning == "Paris." and cut.content is None and cut.reasoning_incomplete is True
    # "document the chosen rule": the docstring states it, and names vLLM's differing parser.
    doc = type(parser).__mro__[1].__doc__ or ""
    assert "finish_reason" in doc and "vLLM" in doc and "RP-04" in doc


@pytest.mark.parametrize("variant", ["draft_and_real", "draft_only"])
def test_tp02_calls_drafted_in_reasoning_are_not_executed(variant):
    case = CASES["TP-02"]
    text = case["input"]["cases"][variant]
    expected = case["expected"][variant]
    parsed = parse_output(
        text,
        prompt_tail=case["input"]["prompt_text_tail"],
        tools=tools("get_time"),
        tool_parser=get_tool_call_parser("hermes"),
        reasoning_parser=get_reasoning_parser("qwen3"),
    )
    items = as_output_items(parsed)
    assert len(parsed.tool_calls) == expected["function_calls"]
    if "output_types" in expected:
        assert [i["type"] for i in items] == expected["output_types"]
    if "output" in expected:
        assert_subset(expected["output"], items)
    draft = text.split("\n</think>")[0]
    # "reasoning text keeps the draft verbatim"
    assert parsed.reasoning == draft
    if variant == "draft_and_real":
        # "the single call is get_time with arguments '{}'"
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_time", "{}")]


def test_tp04_two_calls_in_one_turn():
    case = CASES["TP-04"]
    parsed = parse_output(
        case["input"]["raw_generation_text"],
        tools=tools("write_file", "write_todos"),
        tool_parser=get_tool_call_parser("hermes"),
    )
    assert_subset(case["expected"]["output"], as_output_items(parsed))
    assert parsed.content is None
    # "order preserved"; streaming gives indices 0 and 1 (chat passthrough tool_calls[].index)
    assert [c.name for c in parsed.tool_calls] == ["write_file", "write_todos"]
    streaming = StreamingParser(get_tool_call_parser("hermes"), None, "", tools("write_file", "write_todos"))
    deltas = streaming.feed(case["input"]["raw_generation_text"]) + streaming.finish("stop")
    assert [(d.index, d.name) for d in deltas if d.kind == "tool_call_start"] == [(0, "write_file"), (1, "write_todos")]


@pytest.mark.parametrize("parser_name", ["hermes", "qwen2_5_coder"])
@pytest.mark.parametrize("declared", [("a", "b"), ()])
def test_tp04_malformed_variant_never_raises(parser_name, declared):
    text = CASES["TP-04"]["input"]["malformed_variant"]
    parsed = parse_output(text, tools=tools(*declared), tool_parser=get_tool_call_parser(parser_name))
    # "either two calls or raw text as a message"
    if parsed.tool_calls:
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("a", "{}"), ("b", "{}")]
        assert parsed.content is None
    else:
        assert parsed.content == text.strip()
    if declared:
        assert len(parsed.tool_calls) == 2  # what this implementation chooses: two calls
