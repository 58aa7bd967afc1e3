"""Finding JSON values inside model text, and turning them into tool calls.

The boundary of a JSON value is found by a balanced-bracket scan that respects JSON strings, so a
``</tool_call>`` or ``}`` inside an argument string never ends a call early. The scan only finds
the boundary; ``json.loads`` then decides whether the slice is valid.
"""

from __future__ import annotations

import json
from typing import Any

from gymserve.parsers.base import ParsedToolCall

ARGUMENT_KEYS = ("arguments", "parameters")
"""Keys that hold a call's arguments: Hermes/Qwen templates say ``arguments``, Llama 3's JSON
tool format says ``parameters``; models mix them up, so every format accepts both."""


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object/array opening at ``text[start]`` (``{`` or ``[``).

    Counts ``{[`` against ``}]`` outside strings (a mismatched pair such as ``{]`` still closes, and
    ``json.loads`` rejects the slice later). Returns None when the text ends before the value
    closes, i.e. more text could still complete it.
    """
    depth = 0
    in_string = False
    i = start
    n = len(text)
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2  # skip the escaped character, whatever it is (\" must not end the string)
                continue
            if ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity, which are not JSON: an OpenAI client could not load the
    # arguments string json.dumps would write for them.
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str) -> Any:
    """``json.loads`` that rejects NaN/Infinity; raises ValueError on anything invalid."""
    return json.loads(text, parse_constant=_reject_constant)


def dumps_arguments(obj: dict[str, Any]) -> str:
    """The canonical arguments string: ``json.dumps(obj, ensure_ascii=False)``."""
    return json.dumps(obj, ensure_ascii=False)


def declared_tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """Function names declared in a chat-form or Responses-form tool list (others ignored)."""
    names: set[str] = set()
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
        if isinstance(name, str) and name:
            names.add(name)
    return names


def call_from_obj(obj: Any, declared: set[str] | None = None) -> ParsedToolCall | None:
    """A call from ``{"name": str, "arguments"|"parameters": {...}}``, or None when malformed.

    Missing arguments mean ``{}`` (no-argument calls are often written that way). Arguments given
    as a JSON *string* that decodes to an object are accepted too (models imitate the OpenAI wire
    form). With ``declared`` given, the name must be one of them.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    if declared is not None and name not in declared:
        return None
    args: Any = {}
    for key in ARGUMENT_KEYS:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(name=name, arguments=dumps_arguments(args))


def calls_from_value(value: Any, declared: set[str] | None = None) -> list[ParsedToolCall] | None:
    """Calls from one JSON value: an object is one call, a non-empty list is several; else None."""
    objs = value if isinstance(value, list) else [value]
    if not objs:
        return None
    calls = []
    for obj in objs:
        call = call_from_obj(obj, declared)
        if call is None:
            return None
        calls.append(call)
    return calls


def calls_from_sequence(
    text: str, declared: set[str] | None = None, separators: str = ""
) -> list[ParsedToolCall] | None:
    """Calls when ``text`` is nothing but JSON call values (objects or lists) separated by
    whitespace and optionally one of ``separators`` (``";"`` for Llama 3); else None."""
    calls: list[ParsedToolCall] = []
    i, n = 0, len(text)
    expect_value = True
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return calls if calls and expect_value is False else None
        if not expect_value:
            if text[i] in separators:
                i += 1
                expect_value = True
                continue
            # Another value right after one (no separator): allowed only where none is required.
            if separators:
                return None
        if text[i] not in "{[":
            return None
        end = json_end(text, i)
        if end is None:
            return None
        try:
            found = calls_from_value(loads(text[i:end]), declared)
        except ValueError:
            return None
        if found is None:
            return None
        calls.extend(found)
        i = end
        expect_value = False


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (to hold back
    in streaming: ``"<tool"`` may become ``"<tool_call>"``)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
