"""Tool-call parsers: formats, malformed calls, registry, auto inference."""

from __future__ import annotations

import json

import pytest

from gymserve.parsers import (
    ParsedToolCall,
    ToolCallParser,
    get_tool_call_parser,
    infer_tool_call_parser,
    parse_output,
    register,
    tool_call_parser_names,
)
from gymserve.parsers.json_scan import declared_tool_names, json_end

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


def parse(parser: str, text: str, tools=TOOLS):
    return get_tool_call_parser(parser).parse(text, tools)


def call(name: str, **args) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


# ---------------------------------------------------------------------------------------- hermes


def test_hermes_single_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse("hermes", text) == (None, [call("get_weather", city="Paris")])


def test_hermes_close_tag_inside_argument_string_does_not_end_the_call():
    args = {"html": 'x </tool_call> y "quoted" } {', "n": 1}
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call> bye'
    content, calls = parse("hermes", text)
    assert calls == [ParsedToolCall("get_weather", json.dumps(args, ensure_ascii=False))]
    assert content == "bye"


def test_hermes_several_calls_and_text_around_them():
    text = (
        "Let me check both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n'
        "Then I answer."
    )
    content, calls = parse("hermes", text)
    assert calls == [call("get_weather", city="Rome"), call("get_time", tz="CET")]
    # Text between calls is kept verbatim (each newline that separated the blocks), then stripped.
    assert content == "Let me check both.\n\n\nThen I answer."


def test_arguments_are_the_models_own_text_not_reserialized():
    # What was streamed is what is returned: escapes, spacing and number spelling stay as written.
    raw = '{"city":"S\\u00e3o Paulo",  "days": 1.50}'
    content, calls = parse("hermes", f'<tool_call>{{"name": "get_weather", "arguments": {raw}}}</tool_call>')
    assert calls == [ParsedToolCall("get_weather", raw)] and content is None
    assert json.loads(calls[0].arguments) == {"city": "São Paulo", "days": 1.5}


def test_hermes_call_cut_before_close_tag_counts_if_the_json_is_complete():
    content, calls = parse("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert calls == [call("get_time")] and content is None


def test_hermes_missing_arguments_means_empty_object():
    assert parse("hermes", '<tool_call>{"name": "get_time"}</tool_call>')[1] == [call("get_time")]


def test_hermes_arguments_as_json_string_are_decoded():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert parse("hermes", text)[1] == [call("get_weather", city="Oslo")]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"arguments": {}}</tool_call>',  # name missing
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # name blank
        '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "get_time", "arguments": "nope"}</tool_call>',  # string, not an object
        '<tool_call>{"arguments": {"x": NaN}, "name": "get_time"}</tool_call>',  # NaN is not JSON
        '<tool_call>{"name": 1} trailing</tool_call>',  # name not a string
        "<tool_call></tool_call>",  # empty
        '<tool_call>{"arguments": {"a": "never closed',  # cut before a name was written
    ],
)
def test_hermes_malformed_call_stays_as_text(text):
    content, calls = parse("hermes", text)
    assert calls == []
    assert content == text.strip()


@pytest.mark.parametrize(
    ("text", "arguments", "content"),
    [
        # Once `{"name": "N", "arguments": {` is written the call is committed (its arguments were
        # already streamed): what follows is the call's arguments as written, never content.
        ('<tool_call>{"name": "get_time", "arguments": {"a": "never closed', '{"a": "never closed', None),
        ('<tool_call>{"name": "get_time", "arguments": {"a": 1</tool_call> after', '{"a": 1', "after"),
        ('<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>', '{"x": NaN}', None),
        ('<tool_call>{"name": "get_time", "arguments": {}, "id": 7}</tool_call>', "{}", None),
        ('<tool_call>{"name": "get_time", "arguments": {}} trailing</tool_call>', "{}", "trailing</tool_call>"),
    ],
)
def test_hermes_committed_call_keeps_what_the_model_wrote(text, arguments, content):
    assert parse("hermes", text) == (content, [ParsedToolCall("get_time", arguments)])


def test_hermes_malformed_block_does_not_hide_a_later_good_call():
    bad = '<tool_call>{"name": 1}</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse("hermes", f"{bad}\n{good}")
    assert content == bad and calls == [call("get_time")]


def test_hermes_accepts_undeclared_names_since_the_tags_are_explicit():
    assert parse("hermes", '<tool_call>{"name": "other", "arguments": {}}</tool_call>')[1] == [call("other")]


def test_hermes_plain_text_is_content():
    assert parse("hermes", "  Just an answer with a < sign.\n") == ("Just an answer with a < sign.", [])
    assert parse("hermes", "") == (None, [])


# ------------------------------------------------------------------------------------ llama3_json


def test_llama3_json_whole_message():
    assert parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}') == (
        None,
        [call("get_weather", city="Paris")],
    )


def test_llama3_json_python_tag_and_semicolons():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "arguments": {}}'
    )
    assert parse("llama3_json", text) == (None, [call("get_weather", city="Rome"), call("get_time")])


# Every separator and key spelling Llama 3.x emits (issue #26): Meta's model card spells the
# arguments "parameters", vLLM's llama3_json parser reads "arguments" too and splits on ";", and
# Llama 3.2/3.3 answers put one call per line, or each after its own <|python_tag|>.
_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
_CET = '{"name": "get_time", "parameters": {"tz": "CET"}}'
LLAMA3_TWO_CALLS = [
    _PARIS + "\n" + _CET,
    _PARIS + "\n\n" + _CET,
    _PARIS + "; " + _CET,
    _PARIS + ";" + _CET,
    _PARIS + ";\n" + _CET,
    "<|python_tag|>" + _PARIS + "; " + _CET,
    "<|python_tag|>" + _PARIS + "\n" + _CET,
    "<|python_tag|>" + _PARIS + "<|python_tag|>" + _CET,
    _PARIS + "\n<|python_tag|>" + _CET,
]


@pytest.mark.parametrize("text", LLAMA3_TWO_CALLS)
def test_llama3_json_yields_every_call_whatever_separates_them(text):
    assert parse("llama3_json", text) == (None, [call("get_weather", city="Paris"), call("get_time", tz="CET")])


def test_llama3_json_text_after_newline_separated_calls_stays_content():
    assert parse("llama3_json", _PARIS + "\nThat is all.") == ("That is all.", [call("get_weather", city="Paris")])


def test_llama3_json_text_before_python_tag_is_content():
    text = 'Checking.<|python_tag|>{"name": "get_time", "parameters": {}}'
    assert parse("llama3_json", text) == ("Checking.", [call("get_time")])


def test_llama3_json_ordinary_json_and_undeclared_names_stay_content():
    for text in [
        '{"name": "Bob", "parameters": {}}',
        '{"answer": 4}',
        'The call is {"name": "get_time", "parameters": {}}',
    ]:
        assert parse("llama3_json", text) == (text, [])


def test_llama3_json_python_code_after_tag_stays_content():
    text = "<|python_tag|>print(1)"
    assert parse("llama3_json", text) == (text, [])


# ---------------------------------------------------------------------------------------- mistral


def test_mistral_json_array():
    text = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "get_time", "arguments": {}}]'
    assert parse("mistral", text) == ("Sure.", [call("get_weather", city="Lyon"), call("get_time")])


def test_mistral_v11_name_args_form():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}'
    assert parse("mistral", text) == (None, [call("get_weather", city="Lyon"), call("get_time")])


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather{"city": "Lyon"}',  # v11 as vLLM's parser sees it ([ARGS] skipped)
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Lyon"}',  # v11 with a call id
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}]',
    ],
)
def test_mistral_every_call_form(text):
    assert parse("mistral", text) == (None, [call("get_weather", city="Lyon")])


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS] oops",
        '[TOOL_CALLS][{"name": "x", "arguments": 3}]',
        "[TOOL_CALLS][",
        "[TOOL_CALLS]get_weather[ARGS]nope",
        "[TOOL_CALLS]get weather{}",
    ],
)
def test_mistral_malformed_stays_text(text):
    assert parse("mistral", text) == (text, [])


def test_mistral_call_ids_are_nine_alphanumerics_in_output_and_history():
    parser = get_tool_call_parser("mistral")
    ids = {parser.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids)
    assert parser.history_call_id("a1B2c3D4e") == "a1B2c3D4e"  # already Mistral's form: kept
    mapped = parser.history_call_id("call_9f8e7d6c5b4a")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == parser.history_call_id("call_9f8e7d6c5b4a")
    history = [
        {"role": "assistant", "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "1"},
    ]
    out = parser.history(history)
    assert out[0]["tool_calls"][0]["id"] == out[1]["tool_call_id"] == parser.history_call_id("call_x")
    assert history[1]["tool_call_id"] == "call_x"  # the request itself is not modified
    body = parser.adjust_request({"messages": history, "tools": TOOLS})
    assert body["skip_special_tokens"] is False and body["messages"] == out
    # Other formats keep the caller's ids.
    assert get_tool_call_parser("hermes").history(history) == history


# ---------------------------------------------------------------------------------------- deepseek

DS_CALL = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜>'
DS_TIME = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"


def test_deepseek_v3_calls_and_the_text_before_them():
    text = f"Checking both.<｜tool▁calls▁begin｜>{DS_CALL}\n{DS_TIME}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    assert parse("deepseek_v3", text) == (
        "Checking both.<｜end▁of▁sentence｜>",
        [call("get_weather", city="Rome"), call("get_time")],
    )


def test_deepseek_v31_form_without_the_json_fence():
    text = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜>'
        "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert parse("deepseek_v3", text) == (None, [call("get_weather", city="Rome"), call("get_time")])


def test_deepseek_call_cut_by_the_end_of_the_text_keeps_what_was_written():
    text = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Ro'
    assert parse("deepseek_v3", text) == (None, [ParsedToolCall("get_weather", '{"city": "Ro')])


@pytest.mark.parametrize(
    "text",
    [
        "<｜tool▁calls▁begin｜>not a call<｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n[1]\n```",
    ],
)
def test_deepseek_malformed_block_stays_text(text):
    assert parse("deepseek_v3", text) == (text, [])


# ---------------------------------------------------------------------------------- qwen2_5_coder

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    "text",
    [
        WEATHER,
        f"  \n{WEATHER}\n",
        f"```json\n{WEATHER}\n```",
        f"```\n{WEATHER}\n```",
        f"\n```json\n{WEATHER}\n```\n",
        f"<tool_call>\n{WEATHER}\n</tool_call>",
    ],
)
def test_qwen2_5_coder_single_call_forms(text):
    assert parse("qwen2_5_coder", text) == (None, [call("get_weather", city="Paris")])


def test_qwen2_5_coder_list_of_calls():
    text = f'```json\n[{WEATHER}, {{"name": "get_time", "arguments": {{}}}}]\n```'
    assert parse("qwen2_5_coder", text) == (None, [call("get_weather", city="Paris"), call("get_time")])


def test_qwen2_5_coder_accepts_responses_form_tools():
    assert parse("qwen2_5_coder", WEATHER, RESPONSES_TOOLS)[1] == [call("get_weather", city="Paris")]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "send_email", "arguments": {"to": "x"}}',  # undeclared tool name
        '{"name": "Alice", "age": 30}',  # ordinary JSON answer
        f"Here you go:\n{WEATHER}",  # JSON inside an answer, not the whole message
        f"```python\n{WEATHER}\n```",  # not a JSON fence
        "[1, 2, 3]",
        "```json\n[]\n```",
    ],
)
def test_qwen2_5_coder_ordinary_json_stays_content(text):
    assert parse("qwen2_5_coder", text) == (text.strip(), [])


def test_qwen2_5_coder_text_after_the_calls_is_content():
    for text in (f"```json\n{WEATHER}\n```\nThat is the call.", f"{WEATHER}\nThat is the call."):
        assert parse("qwen2_5_coder", text) == ("That is the call.", [call("get_weather", city="Paris")])


@pytest.mark.parametrize(
    ("parser", "text", "content", "names"),
    [
        # a committed call whose object never closes: the text after its arguments is content
        (
            "llama3_json",
            '{"name": "get_time", "parameters": {}\nI called the clock.',
            "I called the clock.",
            ["get_time"],
        ),
        ("qwen2_5_coder", f"{WEATHER[:-1]}\n\nLet me know.", "Let me know.", ["get_weather"]),
        (
            "hermes",
            '<tool_call>{"name": "get_time", "arguments": {} I will call it }</tool_call>Bye',
            "I will call it }</tool_call>Bye",
            ["get_time"],
        ),
        (
            "llama3_json",
            '{"name": "get_time", "parameters": {}; {"name": "get_weather", "parameters": {}}',
            None,
            ["get_time", "get_weather"],
        ),
        # extra members of a call object are call syntax, skipped whatever their value
        (
            "hermes",
            '<tool_call>{"name": "get_time", "arguments": {}, "id": 1, "x": [{"}": "]"}], "y": null}</tool_call>',
            None,
            ["get_time"],
        ),
    ],
)
def test_text_after_a_committed_call_is_never_lost(parser, text, content, names):
    got_content, calls = parse(parser, text)
    assert got_content == content and [c.name for c in calls] == names


def test_a_name_that_is_not_valid_unicode_is_not_a_call():
    # "\ud800" decodes to a lone surrogate: a response holding it could not be encoded as UTF-8.
    for text in (
        '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}, "name": "\\ud800"}</tool_call>',
    ):
        assert parse("hermes", text) == (text, [])


def test_qwen2_5_coder_bare_json_needs_declared_tools():
    assert parse("qwen2_5_coder", WEATHER, None) == (WEATHER, [])
    assert parse("qwen2_5_coder", WEATHER, []) == (WEATHER, [])


def test_parse_output_without_tools_finds_no_calls():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    for tools in (None, []):
        parsed = parse_output(text, tools=tools, tool_parser=get_tool_call_parser("hermes"))
        assert parsed.tool_calls == [] and parsed.content == text


DEEP = "[" * 3000 + "]" * 3000  # deeper than the stdlib decoder's recursion limit


def test_parsing_never_raises_on_junk():
    junk = [
        "{",
        "[",
        "```",
        '{"name": ',
        "<tool_call>{",
        "[TOOL_CALLS]{",
        "<|python_tag|>[",
        "\\",
        '"',
        "}{][",
        "\x00",
        f'<tool_call>{{"x": {DEEP}}}</tool_call>',
        f'{{"x": {DEEP}}}',
        f'[TOOL_CALLS][{{"x": {DEEP}}}]',
        f'<|python_tag|>{{"parameters": {DEEP}, "name": "get_time"}}',
        f'<tool_call>{{"name": "get_time", "arguments": "{DEEP}"}}</tool_call>',
    ]
    for name in tool_call_parser_names():
        for text in junk:
            content, calls = parse(name, text)
            assert calls == [] and content == (text.strip() or None)


# ---------------------------------------------------------------------------------------- helpers


def test_json_end_respects_strings_and_escapes():
    text = '{"a": "}\\"}", "b": [1, {"c": "]"}]} tail'
    assert text[: json_end(text, 0)] == '{"a": "}\\"}", "b": [1, {"c": "]"}]}'
    assert json_end('{"a": "unterminated}', 0) is None
    assert json_end("[1, 2", 0) is None


def test_declared_tool_names_reads_both_forms():
    assert declared_tool_names(TOOLS + RESPONSES_TOOLS + [{"type": "web_search"}]) == {"get_weather", "get_time"}
    assert declared_tool_names(None) == set()


# --------------------------------------------------------------------------------------- registry


def test_registry_names_and_instances():
    assert {"hermes", "llama3_json", "mistral", "qwen2_5_coder"} <= set(tool_call_parser_names())
    parser = get_tool_call_parser("hermes")
    assert isinstance(parser, ToolCallParser) and parser.name == "hermes"


def test_every_registered_parser_is_named_as_registered():
    """Each registry entry resolves to a class of its kind whose ``name`` is the registered name."""
    from gymserve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ReasoningParser

    for registry, kind in ((TOOL_CALL_PARSERS, ToolCallParser), (REASONING_PARSERS, ReasoningParser)):
        for name in registry.names():
            cls = registry.get(name)
            assert issubclass(cls, kind) and cls.name == name, (registry.kind, name, cls)


def test_unknown_parser_name_lists_the_choices():
    with pytest.raises(ValueError) as err:
        get_tool_call_parser("nope")
    for name in ("hermes", "llama3_json", "mistral", "qwen2_5_coder"):
        assert name in str(err.value)


def test_register_adds_a_parser_and_refuses_a_taken_name(monkeypatch):
    from gymserve.parsers import base

    monkeypatch.setattr(base, "TOOL_CALL_PARSERS", base.TOOL_CALL_PARSERS.copy())  # undone after the test

    @register("test_only_upper")
    class Upper(ToolCallParser):
        def parse_final(self, text, tools):
            return [text.upper()]

    assert "test_only_upper" in tool_call_parser_names()
    assert get_tool_call_parser("test_only_upper").parse("hi", TOOLS) == ("HI", [])
    with pytest.raises(ValueError):

        @register("hermes")
        class Other(ToolCallParser):
            pass

    with pytest.raises(TypeError):
        register("not_a_parser")(int)


# ---------------------------------------------------------------------------------------- infer


@pytest.mark.parametrize(
    ("model_type", "model_name", "template", "expected"),
    [
        ("qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ", "... <tool_call> ...", "qwen2_5_coder"),
        ("qwen2", "Qwen/Qwen2.5-Coder-7B-Instruct", None, "qwen2_5_coder"),
        ("qwen2", "Qwen/Qwen2.5-7B-Instruct", "... <tool_call> ...", "hermes"),
        ("qwen3", "Qwen/Qwen3-8B", None, "hermes"),
        (None, None, "{{ '<tool_call>' }}", "hermes"),
        ("mistral", "mistralai/Mistral-7B-Instruct-v0.3", None, "mistral"),
        (None, None, "[TOOL_CALLS]", "mistral"),
        ("llama", "meta-llama/Llama-3.1-8B-Instruct", None, "llama3_json"),
        (None, None, "<|python_tag|>", "llama3_json"),
        (None, "NousResearch/Hermes-3-Llama-3.1-8B", "<tool_call>", "hermes"),
        ("qwen3_moe", "Qwen/Qwen3-Coder-30B-A3B-Instruct", "{{ '<tool_call>\\n<function=' }}", "qwen3_coder"),
        ("deepseek_v3", "deepseek-ai/DeepSeek-V3", None, "deepseek_v3"),
        (None, "deepseek-ai/DeepSeek-R1", None, "deepseek_v3"),
        (None, None, "{{ '<｜tool▁calls▁begin｜>' }}", "deepseek_v3"),
        ("gpt_oss", "openai/gpt-oss-20b", None, "openai"),
    ],
)
def test_infer_tool_call_parser(model_type, model_name, template, expected):
    name, reason = infer_tool_call_parser(model_type, model_name, template)
    assert name == expected and reason


@pytest.mark.parametrize(
    ("model_type", "model_name", "template"),
    [("gpt2", "gpt2", None), (None, None, None)],
)
def test_infer_tool_call_parser_refuses_to_guess(model_type, model_name, template):
    with pytest.raises(ValueError) as err:
        infer_tool_call_parser(model_type, model_name, template)
    assert "hermes" in str(err.value) and "qwen2_5_coder" in str(err.value)
