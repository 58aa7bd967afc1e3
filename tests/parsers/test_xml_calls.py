"""Qwen3-Coder XML tool calls: values typed by the schema, lenient end tags, streaming per parameter."""

from __future__ import annotations

import json

import pytest

from gymserve.parsers import ParsedToolCall, StreamingParser, get_tool_call_parser
from gymserve.parsers.xml_calls import convert_value

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "parameters": {
                "type": "object",
                "properties": {
                    "cmd": {"type": "string"},
                    "n": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "dry": {"type": "boolean"},
                    "env": {"type": "object"},
                    "args": {"type": "array"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
            },
        },
    }
]


def parse(text: str, tools=TOOLS):
    return get_tool_call_parser("qwen3_coder").parse(text, tools)


def xml(*params: tuple[str, str], name: str = "run") -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_values_are_typed_by_the_tools_schema():
    text = xml(
        ("cmd", "ls -la\nwc -l"),
        ("n", "3"),
        ("ratio", "0.5"),
        ("dry", "true"),
        ("env", '{"A": "1"}'),
        ("args", "['-x', 2]"),  # a Python literal: models write these too
        ("note", "None"),
        ("extra", "42"),  # not in the schema: text
    )
    content, calls = parse(text)
    assert content is None and [c.name for c in calls] == ["run"]
    assert json.loads(calls[0].arguments) == {
        "cmd": "ls -la\nwc -l",
        "n": 3,
        "ratio": 0.5,
        "dry": True,
        "env": {"A": "1"},
        "args": ["-x", 2],
        "note": None,
        "extra": "42",
    }
    # The arguments are json.dumps of the parameters, in the order written.
    assert calls[0].arguments.startswith('{"cmd": "ls -la\\nwc -l", "n": 3')


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("abc", {"type": "integer"}, "abc"),  # does not convert: stays text
        ("null", {"type": "string"}, "null"),  # a string stays a string
        ("null", {"type": "integer"}, None),
        ("1.0", {"type": "number"}, 1),
        ("maybe", {"type": "boolean"}, "maybe"),
        ("{bad", {"type": "object"}, "{bad"),
    ],
)
def test_conversion_edge_cases(value, schema, expected):
    assert convert_value(value, schema) == expected


def test_missing_end_tags_and_undeclared_functions():
    text = "<tool_call>\n<function=other>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>"
    assert parse(text)[1] == [ParsedToolCall("other", '{"a": "x", "b": "y"}')]


def test_text_around_calls_is_content_and_a_block_that_is_not_xml_stays_text():
    text = f"Running it.\n{xml(('cmd', 'ls'))}\nDone. <tool_call>oops</tool_call>"
    content, calls = parse(text)
    assert calls == [ParsedToolCall("run", '{"cmd": "ls"}')]
    assert content == "Running it.\n\nDone. <tool_call>oops</tool_call>"


def test_duplicate_parameters_keep_the_first():
    assert parse(xml(("n", "1"), ("n", "2")))[1] == [ParsedToolCall("run", '{"n": 1}')]


def test_parameters_stream_one_by_one():
    parser = StreamingParser(get_tool_call_parser("qwen3_coder"), None, "", TOOLS)
    deltas = parser.feed("<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n<parameter=n>\n4")
    assert [(d.kind, d.name or d.text) for d in deltas] == [
        ("tool_call_start", "run"),
        ("tool_call_arguments", "{"),
        ("tool_call_arguments", '"cmd": "ls"'),
    ]
    deltas = parser.feed("\n</parameter>\n</function>\n</tool_call>") + parser.finish()
    assert [d.text for d in deltas] == [', "n": 4', "}"]
