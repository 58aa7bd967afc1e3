"""Reasoning parsers: <think> spans decided by the real prompt tail and the finish reason."""

from __future__ import annotations

import pytest

from gymserve.parsers import ReasoningParser, get_reasoning_parser, parse_output, reasoning_parser_names

THINK_TAIL = "<|im_start|>assistant\n<think>\n"
PLAIN_TAIL = "<|im_start|>assistant\n"
NO_THINK_TAIL = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 enable_thinking=False

NAMES = ["qwen3", "deepseek_r1"]


@pytest.fixture(params=NAMES)
def parser(request) -> ReasoningParser:
    return get_reasoning_parser(request.param)


def test_registry():
    assert {"qwen3", "deepseek_r1"} <= set(reasoning_parser_names())
    assert get_reasoning_parser("qwen3").name == "qwen3"
    with pytest.raises(ValueError) as err:
        get_reasoning_parser("nope")
    assert "qwen3" in str(err.value) and "deepseek_r1" in str(err.value)


@pytest.mark.parametrize(
    ("text", "tail", "finish", "expected"),
    [
        # pre-filled <think>: the generation holds only </think> (RP-01)
        ("Sum is 4.\n</think>\n\nIt is 4.", THINK_TAIL, "stop", ("Sum is 4.", "It is 4.", False)),
        # the model opens the span itself
        ("<think>\nSum is 4.\n</think>\n\nIt is 4.", PLAIN_TAIL, "stop", ("Sum is 4.", "It is 4.", False)),
        ("  <think>x</think>y", PLAIN_TAIL, "stop", ("x", "y", False)),
        # no tags, prompt not pre-filling → no reasoning
        ("It is 4.", PLAIN_TAIL, "stop", (None, "It is 4.", False)),
        ("It is 4.", PLAIN_TAIL, "length", (None, "It is 4.", False)),
        # pre-filled but never closed: finish reason decides (RP-04)
        ("Paris.", THINK_TAIL, "stop", (None, "Paris.", False)),
        ("Thinking about Par", THINK_TAIL, "length", ("Thinking about Par", "", True)),
        ("<think>\nPar", PLAIN_TAIL, "length", ("Par", "", True)),
        # opened by the model itself: reasoning however it ends (so it can stream as generated)
        ("<think>\nParis.", PLAIN_TAIL, "stop", ("Paris.", "", False)),
        # an empty span is no reasoning
        ("<think>\n\n</think>\n\nHi", PLAIN_TAIL, "stop", (None, "Hi", False)),
        ("</think>Hi", THINK_TAIL, "stop", (None, "Hi", False)),
        # thinking disabled: the pre-filled span is already closed
        ("Hi", NO_THINK_TAIL, "stop", (None, "Hi", False)),
        ("Hi", NO_THINK_TAIL, "length", (None, "Hi", False)),
        # unknown prompt (""): a lone </think> still closes a span
        ("Sum.\n</think>\nIt is 4.", "", "stop", ("Sum.", "It is 4.", False)),
        ("It is 4.", "", "stop", (None, "It is 4.", False)),
        # tags elsewhere stay verbatim; only the first </think> closes
        ("a</think>b</think>c", THINK_TAIL, "stop", ("a", "b</think>c", False)),
        ("", THINK_TAIL, "stop", (None, "", False)),
        ("", THINK_TAIL, "length", (None, "", True)),
    ],
)
def test_split(parser, text, tail, finish, expected):
    assert parser.split(text, tail, finish) == expected


def test_rest_is_a_suffix_of_the_text(parser):
    for text in ["a</think>\n b", "<think>x</think>y", "plain", "<think>open"]:
        for finish in ("stop", "length"):
            _, rest, _ = parser.split(text, THINK_TAIL, finish)
            assert text.endswith(rest)


def test_split_partial_waits_until_decided(parser):
    assert parser.split_partial("I think", THINK_TAIL) is None  # may still close, or end as content
    assert parser.split_partial("I think</think>\nAns", THINK_TAIL) == ("I think", "Ans")
    assert parser.split_partial("<thi", PLAIN_TAIL) is None  # may become <think>
    assert parser.split_partial("  ", PLAIN_TAIL) is None
    assert parser.split_partial("Hello", PLAIN_TAIL) == (None, "Hello")


def test_parse_output_reasoning_then_content():
    parsed = parse_output(
        "Because.\n</think>\n\nYes.", prompt_tail=THINK_TAIL, reasoning_parser=get_reasoning_parser("qwen3")
    )
    assert (parsed.reasoning, parsed.content, parsed.tool_calls, parsed.reasoning_incomplete) == (
        "Because.",
        "Yes.",
        [],
        False,
    )


def test_parse_output_truncated_reasoning_is_incomplete():
    parsed = parse_output(
        "Let me think about",
        prompt_tail=THINK_TAIL,
        finish_reason="length",
        reasoning_parser=get_reasoning_parser("deepseek_r1"),
    )
    assert parsed.reasoning == "Let me think about" and parsed.content is None and parsed.reasoning_incomplete


def test_parse_output_without_reasoning_parser_keeps_tags_as_content():
    parsed = parse_output("<think>x</think>y")
    assert parsed.reasoning is None and parsed.content == "<think>x</think>y"
