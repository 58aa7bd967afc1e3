"""Streaming parser: deltas, concatenated, equal the whole-text parse however the text is split."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymserve.parsers import (
    Delta,
    ParsedOutput,
    ParsedToolCall,
    StreamingParser,
    get_reasoning_parser,
    get_tool_call_parser,
    parse_output,
    tool_call_parser_names,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
]
THINK_TAIL = "<|im_start|>assistant\n<think>\n"
PLAIN_TAIL = "<|im_start|>assistant\n"

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris </tool_call> \\"x\\" é"}}'
TIME = '{"name": "get_time", "arguments": {}}'

TEXTS = [
    "The user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.",
    "Paris.",
    "<think>\nhmm\n</think>\n\nHello there.\n",
    f"Plan: call <tool_call>{TIME}</tool_call> first.\n</think>\n\n<tool_call>\n{TIME}\n</tool_call>",
    f"Maybe <tool_call>{TIME}</tool_call>?\n</think>\n\nI do not need a tool.",
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\nDone.",
    f"<tool_call>\n{TIME}\n{WEATHER}\n</tool_call>",
    '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call> after',
    '<tool_call>{"name": "get_time", "arguments": {"a": "unterminated}</tool_call> x',
    f"```json\n{WEATHER}\n```",
    f"  {WEATHER}  ",
    f"[{WEATHER}, {TIME}]",
    '{"name": "nope", "arguments": {}}',
    'Here is JSON: {"name": "get_time", "arguments": {}}',
    f"<|python_tag|>{WEATHER.replace('arguments', 'parameters')}; {TIME}",
    f"{TIME}; {WEATHER}",
    f"Sure [TOOL_CALLS][{WEATHER}, {TIME}]",
    '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
    "[TOOL_CALLS]not json",
    "a < b and c <tool but not a call <tool_cal",
    "",
    "   ",
    "</think>",
    "<think>never closed",
    # commit-rule paths: cut inside arguments, close tag inside them, extra members, other key
    # orders, arguments as a string, a list in a block, text after bare calls
    '<tool_call>{"name": "get_time", "arguments": {"a": "cut',
    '<tool_call>{"name": "get_time", "arguments": {"a": 1</tool_call> after <tool_call>' + TIME,
    '<tool_call>{"name": "get_time", "arguments": {}, "id": "x}"} </tool_call>',
    '<tool_call>{"arguments": {"a": 1}, "name": "get_time"}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": "{\\"a\\": 1}"}</tool_call>',
    f"<tool_call>[{TIME}, {WEATHER}]</tool_call>",
    f"{WEATHER} then some words",
    f"```json\n{TIME}\n```\nAnd text.",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"',
    f"[{TIME}, 3]",
    '{"name": "get_time", "arguments": {}\nI called it.',
    '<tool_call>{"name": "get_time", "arguments": {} junk }</tool_call>x',
    '<tool_call>{"name": "get_time", "arguments": {}, "id": 12, "n": [1, "]"]}</tool_call>',
    "x</think>\x0b\u2028" + TIME,
    # named-call heads and XML calls (Mistral v11 forms, DeepSeek V3/V3.1, Qwen3-Coder)
    '[TOOL_CALLS]get_weather{"city": "Lyon"}[TOOL_CALLS]get_time[CALL_ID]abcdefghi[ARGS]{}',
    "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "}```"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{",
    "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis </parameter> x\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call> done",
    "<tool_call>\n<function=get_time>\n<parameter=a>\nno end tag\n<parameter=b>\n2\n</function>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\ncut",
    "<tool_call>not xml</tool_call><tool_call><function=get_time></function></tool_call>",
]


def collect(deltas: list[Delta]) -> ParsedOutput:
    """Concatenate deltas into the shape parse_output returns."""
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        if d.kind == "tool_call_start":
            assert d.index == len(names), "call indices are 0, 1, ... in order"
            names[d.index] = d.name
            args[d.index] = ""
        elif d.kind == "tool_call_arguments":
            assert d.index in names, "arguments only after the call started"
            args[d.index] += d.text
    calls = [ParsedToolCall(names[i], args[i]) for i in sorted(names)]
    return ParsedOutput(reasoning or None, content or None, calls)


def stream(text: str, cuts: list[int], finish_reason: str, **kw) -> tuple[ParsedOutput, list[Delta], bool]:
    parser = StreamingParser(kw["tool_parser"], kw["reasoning_parser"], kw["prompt_tail"], kw["tools"])
    deltas: list[Delta] = []
    last = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        deltas += parser.feed(text[last:cut])
        last = cut
    deltas += parser.finish(finish_reason)
    return collect(deltas), deltas, parser.reasoning_incomplete


def assert_agrees(text, cuts, finish_reason, tool_name, reasoning_name, prompt_tail, tools):
    kw = dict(
        tool_parser=get_tool_call_parser(tool_name) if tool_name else None,
        reasoning_parser=get_reasoning_parser(reasoning_name) if reasoning_name else None,
        prompt_tail=prompt_tail,
        tools=tools,
    )
    whole = parse_output(text, finish_reason=finish_reason, **kw)
    got, deltas, incomplete = stream(text, cuts, finish_reason, **kw)
    assert got.reasoning == whole.reasoning
    assert got.content == whole.content
    assert got.tool_calls == whole.tool_calls
    assert incomplete == whole.reasoning_incomplete
    for d in deltas:
        if d.kind == "content" and "<tool_call>" not in (whole.content or ""):
            assert "<tool_call>" not in d.text


parsers = st.sampled_from([None, *tool_call_parser_names()])
reasoners = st.sampled_from([None, "qwen3", "deepseek_r1"])
tails = st.sampled_from(["", THINK_TAIL, PLAIN_TAIL, "<think>\n\n</think>\n\n"])
finishes = st.sampled_from(["stop", "length"])
tool_lists = st.sampled_from([TOOLS, None])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(TEXTS), st.data(), parsers, reasoners, tails, finishes, tool_lists)
def test_stream_equals_whole_parse_for_known_texts(text, data, tool_name, reasoning_name, tail, finish, tools):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_agrees(text, cuts, finish, tool_name, reasoning_name, tail, tools)


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool",
    "</thi",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    ":",
    ",",
    ";",
    '"get_time"',
    '"get_weather"',
    '"x"',
    "{}",
    " ",
    "\n",
    "a",
    "```",
    "json",
    '"',
    "\\",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "get_time",
    "é",
    "<",
    "NaN",
    "1",
    # call heads, so random texts often commit to a call and then go wrong
    '{"name": "get_time", "arguments": ',
    '{"name": "get_weather", "parameters": ',
    '"a": ',
    # whole well-formed pieces, so random texts also hold real calls
    f"<tool_call>{TIME}</tool_call>",
    WEATHER,
    TIME,
    f"[{TIME}]",
    f"```json\n{TIME}\n```",
    "get_time[ARGS]{}",
]


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join),
    st.data(),
    parsers,
    reasoners,
    tails,
    finishes,
    tool_lists,
)
def test_stream_equals_whole_parse_for_random_texts(text, data, tool_name, reasoning_name, tail, finish, tools):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_agrees(text, cuts, finish, tool_name, reasoning_name, tail, tools)


@pytest.mark.parametrize("space", ["\x0b", "\xa0", "\u2028", "\u3000", "\x85"])
@pytest.mark.parametrize("tool_name", ["qwen2_5_coder", "llama3_json"])
def test_unicode_whitespace_after_think_agrees_however_it_is_cut(space, tool_name):
    # str.strip (the reasoning split) strips more than JSON whitespace; a cut right after </think>
    # hands that whitespace to the bare-JSON scanner, which must skip it the same way.
    text = f"x</think>{space}{TIME}"
    for cut in range(len(text) + 1):
        assert_agrees(text, [cut, text.index(space)], "stop", tool_name, "qwen3", THINK_TAIL, TOOLS)


def test_content_streams_before_the_end_and_holds_partial_tags():
    parser = StreamingParser(get_tool_call_parser("hermes"), None, "", TOOLS)
    assert parser.feed("Let me check") == [Delta("content", "Let me check")]
    # "<tool" may become "<tool_call>": held back, never shown as content.
    assert parser.feed(" the weather <tool") == [Delta("content", " the weather")]
    assert parser.feed("_call>\n" + TIME[:10]) == []
    deltas = parser.feed(TIME[10:] + "\n</tool_call>")
    assert deltas == [
        Delta("tool_call_start", index=0, name="get_time"),
        Delta("tool_call_arguments", "{}", index=0),
    ]
    assert parser.finish("stop") == []


ARGS = '{"city": "Paris </tool_call> \\"x\\" é"}'


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>"),
        ("qwen2_5_coder", WEATHER),
        ("qwen2_5_coder", f"```json\n{WEATHER}\n```"),
        ("qwen2_5_coder", f"[{WEATHER}]"),
        ("llama3_json", WEATHER.replace("arguments", "parameters")),
        ("llama3_json", f"<|python_tag|>{WEATHER}"),
        ("mistral", f"[TOOL_CALLS][{WEATHER}]"),
        ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{ARGS}"),
    ],
)
def test_arguments_stream_as_the_model_writes_them(name, text):
    parser = StreamingParser(get_tool_call_parser(name), None, "", TOOLS)
    head = text.index('{"city"') + len('{"ci')
    early = [d for ch in text[:head] for d in parser.feed(ch)]
    # The call started, and the arguments written so far went out, before the arguments closed.
    assert early[0] == Delta("tool_call_start", index=0, name="get_weather")
    assert "".join(d.text for d in early[1:]) == '{"ci'
    late = [d for ch in text[head:] for d in parser.feed(ch)] + parser.finish("stop")
    pieces = [d.text for d in early[1:] + late if d.kind == "tool_call_arguments"]
    assert len(pieces) == len(ARGS) and "".join(pieces) == ARGS  # one delta per character fed
    assert not [d for d in late if d.kind != "tool_call_arguments"]


def test_a_call_is_not_started_before_its_head_decides_it():
    parser = StreamingParser(get_tool_call_parser("qwen2_5_coder"), None, "", TOOLS)
    assert parser.feed('{"name": "get_weather", "arguments"') == []  # may still be any JSON
    assert parser.feed(": {") == [
        Delta("tool_call_start", index=0, name="get_weather"),
        Delta("tool_call_arguments", "{", index=0),
    ]
    # An undeclared name is an ordinary JSON answer: content, once the value closes.
    parser = StreamingParser(get_tool_call_parser("qwen2_5_coder"), None, "", TOOLS)
    assert parser.feed('{"name": "Alice", "arguments": {"age": 3') == []
    assert parser.feed("0}}") == [Delta("content", '{"name": "Alice", "arguments": {"age": 30}}')]


def test_reasoning_is_emitted_when_think_closes():
    parser = StreamingParser(None, get_reasoning_parser("qwen3"), THINK_TAIL, None)
    assert parser.feed("I think ") == []
    assert parser.feed("it is 4.\n</think>\n\nThe ") == [
        Delta("reasoning", "I think it is 4."),
        Delta("content", "The"),
    ]
    assert parser.feed("answer is 4.") == [Delta("content", " answer is 4.")]
    assert parser.finish("stop") == []


def test_reasoning_the_model_opened_streams_as_generated():
    parser = StreamingParser(None, get_reasoning_parser("qwen3"), PLAIN_TAIL, None)
    assert parser.feed("<thi") == []  # may be a tag or text
    assert parser.feed("nk>\nI think ") == [Delta("reasoning", "I think")]
    assert parser.feed("it is 4.\n</thi") == [Delta("reasoning", " it is 4.")]  # </thi held back
    assert parser.feed("nk>\n\nThe answer") == [Delta("content", "The answer")]
    assert parser.finish("stop") == [] and not parser.reasoning_incomplete


def test_unclosed_reasoning_decided_by_finish_reason():
    for finish, expected in [("stop", [Delta("content", "Paris.")]), ("length", [Delta("reasoning", "Paris.")])]:
        parser = StreamingParser(None, get_reasoning_parser("qwen3"), "<|assistant|><think>", None)
        assert parser.feed("Paris.") == []
        assert parser.finish(finish) == expected
        assert parser.reasoning_incomplete is (finish == "length")


def test_feed_after_finish_raises():
    parser = StreamingParser(None, None)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


@pytest.mark.parametrize("separator", ["\n", "\n\n", "; ", ";\n", "<|python_tag|>", "\n<|python_tag|>"])
@pytest.mark.parametrize("tagged", [False, True])
def test_llama3_calls_stream_as_parsed_whatever_separates_them(separator, tagged):
    """Streamed one character at a time, every Llama 3.x separator gives the calls the whole-text
    parse gives: both of them, none left as content (issue #26)."""
    a = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    b = '{"name": "get_time", "parameters": {"tz": "CET"}}'
    text = ("<|python_tag|>" if tagged else "") + a + separator + b
    assert_agrees(text, list(range(len(text))), "stop", "llama3_json", None, "", TOOLS)
    whole = parse_output(text, tool_parser=get_tool_call_parser("llama3_json"), tools=TOOLS, finish_reason="stop")
    assert [c.name for c in whole.tool_calls] == ["get_weather", "get_time"] and not whole.content
