"""gpt-oss harmony parsing: channels, recipients, call/return markers; streaming equals whole text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymserve.parsers import (
    ParsedOutput,
    ParsedToolCall,
    StreamingParser,
    get_reasoning_parser,
    get_tool_call_parser,
    infer_tool_call_parser,
    parse_output,
)
from gymserve.parsers.harmony import parse_header

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
TP, RP = get_tool_call_parser("openai"), get_reasoning_parser("openai_gptoss")

ANALYSIS = "<|channel|>analysis<|message|>User asks the weather in Oslo. Need tool.<|end|>"
CALL_AFTER_CHANNEL = (
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
)
CALL_BEFORE_CHANNEL = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 20 °C in Oslo."


def parse(text: str, tools=TOOLS, finish: str = "stop", tp=TP, rp=RP) -> ParsedOutput:
    return parse_output(text, finish_reason=finish, tools=tools, tool_parser=tp, reasoning_parser=rp)


@pytest.mark.parametrize("call", [CALL_AFTER_CHANNEL, CALL_BEFORE_CHANNEL])
@pytest.mark.parametrize("end", ["", "<|call|>"])  # the engine trims its stop token, or not
def test_tool_call_with_the_recipient_before_or_after_the_channel(call, end):
    out = parse(ANALYSIS + call + end)
    assert out == ParsedOutput(
        reasoning="User asks the weather in Oslo. Need tool.",
        content=None,
        tool_calls=[ParsedToolCall("get_weather", '{"city":"Oslo"}')],
    )


@pytest.mark.parametrize("end", ["", "<|return|>", "<|end|>"])
def test_final_answer_after_analysis(end):
    assert parse(ANALYSIS + FINAL + end) == ParsedOutput(
        "User asks the weather in Oslo. Need tool.", "It is 20 °C in Oslo.", []
    )


def test_preamble_on_commentary_is_content_and_several_calls_in_one_generation():
    text = (
        ANALYSIS
        + "<|start|>assistant<|channel|>commentary<|message|>**Plan**: check, then answer.<|end|>"
        + CALL_AFTER_CHANNEL
        + "<|call|>"
        + "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|><|call|>"
    )
    out = parse(text)
    assert out.content == "**Plan**: check, then answer."
    assert out.tool_calls == [ParsedToolCall("get_weather", '{"city":"Oslo"}'), ParsedToolCall("get_time", "{}")]


def test_several_analysis_messages_join_with_a_blank_line_and_so_does_content():
    text = (
        "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>pre<|end|>"
        "<|start|>assistant<|channel|>final<|message|>answer<|return|>"
    )
    assert parse(text) == ParsedOutput("one\n\ntwo", "pre\n\nanswer", [])


def test_builtin_tool_recipients_and_recipients_that_address_no_tool():
    assert parse_header("assistant to=browser.search<|channel|>analysis") == ("analysis", "browser.search")
    assert parse_header("<|channel|>commentary to=functions.get_weather <|constrain|>json") == (
        "commentary",
        "get_weather",
    )
    assert parse_header("functions.get_weather to=assistant<|channel|>commentary") == ("commentary", None)
    assert parse_header("<|channel|>final") == ("final", None)
    # A call on the analysis channel (the model may call tools while reasoning) is a call.
    text = "<|channel|>analysis to=python code<|message|>print(1)<|call|>"
    assert parse(text).tool_calls == [ParsedToolCall("python", "print(1)")]


def test_no_tools_declared_means_no_calls_and_nothing_lost():
    out = parse(ANALYSIS + CALL_AFTER_CHANNEL, tools=None)
    assert out.tool_calls == [] and out.content == '{"city":"Oslo"}'
    # Either parser of the pair alone reads the whole format.
    assert parse(ANALYSIS + FINAL, tp=None) == parse(ANALYSIS + FINAL, rp=None) == parse(ANALYSIS + FINAL)


def test_generation_cut_inside_the_analysis_is_incomplete_reasoning():
    out = parse("<|channel|>analysis<|message|>Let me think about", finish="length")
    assert out == ParsedOutput("Let me think about", None, [], reasoning_incomplete=True)
    assert not parse("<|channel|>analysis<|message|>x", finish="stop").reasoning_incomplete


def test_text_that_is_not_harmony_is_content_and_a_cut_header_is_dropped():
    assert parse("Plain answer.") == ParsedOutput(None, "Plain answer.", [])
    assert parse(ANALYSIS + "<|start|>assistant<|channel|>fin", finish="length") == ParsedOutput(
        "User asks the weather in Oslo. Need tool.", None, []
    )


def test_inference_picks_the_pair_for_gpt_oss():
    assert infer_tool_call_parser("gpt_oss", "openai/gpt-oss-20b", None)[0] == "openai"
    assert infer_tool_call_parser("qwen2", "x", "{{ '<|start|>assistant<|channel|>final' }}")[0] == "openai"


# ---------------------------------------------------------------------------------- streaming

TEXTS = [
    ANALYSIS + CALL_AFTER_CHANNEL + "<|call|>",
    ANALYSIS + CALL_BEFORE_CHANNEL,
    ANALYSIS + FINAL + "<|return|>",
    "<|channel|>analysis<|message|>a <|end|> b<|end|><|start|>assistant<|channel|>final<|message|>  x  ",
    "Plain answer, no header.",
    "  <|channel|>final<|message|>spaced",
    "<|channel|>analysis<|message|>cut",
    ANALYSIS + "stray text<|start|>assistant<|channel|>final<|message|>y",
    "<|channel|>analysis<|end|>no body<|start|>assistant<|channel|>final<|message|>z",
    '<|channel|>commentary to=functions.get_weather<|message|>{"a": "<|"}<|call|>',
    "",
]


def stream(text: str, cuts: list[int], tools, finish: str) -> ParsedOutput:
    parser = StreamingParser(TP, RP, "", tools)
    deltas, last = [], 0
    for cut in [*sorted(cuts), len(text)]:
        deltas += parser.feed(text[last:cut])
        last = cut
    deltas += parser.finish(finish)
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning") or None
    content = "".join(d.text for d in deltas if d.kind == "content") or None
    calls: list[ParsedToolCall] = []
    for d in deltas:
        if d.kind == "tool_call_start":
            calls.append(ParsedToolCall(d.name or "", ""))
        elif d.kind == "tool_call_arguments":
            calls[-1].arguments += d.text
    return ParsedOutput(reasoning, content, calls, parser.reasoning_incomplete)


@settings(max_examples=300, deadline=None)
@given(
    text=st.sampled_from(TEXTS),
    data=st.data(),
    tools=st.sampled_from([TOOLS, None]),
    finish=st.sampled_from(["stop", "length"]),
)
def test_streaming_equals_the_whole_text_however_it_is_split(text, data, tools, finish):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert stream(text, cuts, tools, finish) == parse(text, tools=tools, finish=finish)


def test_reasoning_and_arguments_stream_as_they_are_written():
    parser = StreamingParser(TP, RP, "", TOOLS)
    assert [d.text for d in parser.feed("<|channel|>analysis<|message|>Thinking hard")] == ["Thinking hard"]
    deltas = parser.feed('<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"ci')
    assert [(d.kind, d.name or d.text) for d in deltas] == [
        ("tool_call_start", "get_weather"),
        ("tool_call_arguments", '{"ci'),
    ]
