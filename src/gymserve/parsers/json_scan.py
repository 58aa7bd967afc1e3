"""JSON pieces of tool-call parsing: bracket boundaries found incrementally, and the members of a
call object with the exact text span of each value.

Boundaries come from a bracket count that respects JSON strings, so a ``</tool_call>`` or ``}``
inside an argument string never ends a call early; the count runs incrementally, so a long
argument string streamed over thousands of deltas is scanned once. Validity is left to the
standard library's decoder (``json.JSONDecoder.raw_decode``), which also gives the span of each
value, so a call's arguments can be returned exactly as the model spelled them.
"""

from __future__ import annotations

import json

# typeshed's json.decoder stub omits scanstring (it leaves it out of __all__), though the module
# has always exported it at runtime (the C scanner or its pure-Python fallback).
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")
"""Keys that hold a call's arguments: Hermes/Qwen templates say ``arguments``, Llama 3's JSON
tool format says ``parameters``; models mix them up, so every format accepts both."""

JSON_WS = " \t\n\r"
"""Whitespace as RFC 8259 defines it (``str.isspace`` accepts more)."""


def skip_ws(text: str, pos: int) -> int:
    """First index at or after ``pos`` that is not JSON whitespace (``len(text)`` if none)."""
    n = len(text)
    while pos < n and text[pos] in JSON_WS:
        pos += 1
    return pos


class Brackets:
    """Incremental bracket depth over JSON text, respecting strings and escapes.

    ``Brackets(depth)`` starts at ``depth`` open brackets (0 before a value's opening bracket; 1 to
    continue inside an object). :meth:`advance` scans on from an index and keeps its state, so a
    growing text is scanned once in total. Mismatched pairs such as ``{]`` still count as a close;
    the decoder rejects the slice later.
    """

    __slots__ = ("depth", "in_string", "escape")

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.in_string = False
        self.escape = False

    def advance(self, text: str, i: int, stop: str | None = None, pause_depth: int = 0) -> tuple[int, str]:
        """Scan ``text`` from ``i``: returns ``(j, outcome)``.

        ``"closed"``: ``text[j - 1]`` closed the outermost bracket, or the string a scan at depth
        0 started in. ``"deeper"``: ``text[j - 1]`` opened a bracket that made the depth
        ``pause_depth`` (only when it is given). ``"stop"``: ``text[j:]`` starts with ``stop``
        outside a string (an end tag inside unclosed JSON). ``"more"``: the text ran out at ``j``
        (``j < len(text)`` when a prefix of ``stop`` starts at ``j``: it is not scanned until the
        text says whether the tag completes). The next call resumes at ``j``.
        """
        n = len(text)
        while i < n:
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True  # \" must not end the string
                elif ch == '"':
                    self.in_string = False
                    if self.depth <= 0:
                        return i + 1, "closed"
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                if self.depth == pause_depth:
                    return i + 1, "deeper"
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1, "closed"
            elif stop and ch == stop[0]:
                if text.startswith(stop, i):
                    return i, "stop"
                if stop.startswith(text[i : i + len(stop)]):
                    return i, "more"
            i += 1
        return n, "more"


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object/array opening at ``text[start]``, or None when the text
    ends before it closes (more text could still complete it)."""
    end, outcome = Brackets().advance(text, start)
    return end if outcome == "closed" else None


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity, which are not JSON: an OpenAI client in another language
    # could not load them.
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def loads(text: str) -> Any:
    """``json.loads`` that rejects NaN/Infinity; raises ValueError on anything invalid."""
    return _DECODER.decode(text)


def object_members(text: str) -> dict[str, tuple[Any, int, int]] | None:
    """Members of the JSON object that is exactly ``text``: ``{key: (value, start, end)}`` with
    ``text[start:end]`` the value's own spelling; the first of duplicate keys wins. None when
    ``text`` is not one valid JSON object."""
    members: dict[str, tuple[Any, int, int]] = {}
    last = len(text) - 1
    try:
        if text[0] != "{":
            return None
        i = skip_ws(text, 1)
        if text[i] == "}":
            return members if i == last else None
        while True:
            if text[i] != '"':
                return None
            key, i = scanstring(text, i + 1)
            i = skip_ws(text, i)
            if text[i] != ":":
                return None
            start = skip_ws(text, i + 1)
            value, end = _DECODER.raw_decode(text, start)
            members.setdefault(key, (value, start, end))
            i = skip_ws(text, end)
            if text[i] == ",":
                i = skip_ws(text, i + 1)
            elif text[i] == "}" and i == last:
                return members
            else:
                return None
    except (ValueError, IndexError, RecursionError):  # the decoder recurses: deep nesting is model output too
        return None


def encodable(text: str) -> bool:
    """Whether ``text`` can be sent as UTF-8: a JSON escape such as ``\\ud800`` decodes to a lone
    surrogate, which would make the response unserializable."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def valid_name(name: object, declared: set[str] | None) -> bool:
    """Whether ``name`` can name a call: a non-blank string that can be sent as UTF-8, and one of
    ``declared`` when that is given."""
    return isinstance(name, str) and bool(name.strip()) and encodable(name) and (declared is None or name in declared)


def call_in_object(text: str, declared: set[str] | None = None) -> tuple[str, str] | None:
    """``(name, arguments)`` of a complete call object ``{"name": str, "arguments"|"parameters":
    {...}}`` written as ``text``, or None when it is not one.

    ``arguments`` is the model's own text of the arguments object. Missing arguments mean ``"{}"``
    (no-argument calls are often written that way); arguments given as a JSON *string* holding an
    object (models imitate the OpenAI wire form) are that string. With ``declared`` given, the name
    must be one of them.
    """
    members = object_members(text)
    if members is None or "name" not in members:
        return None
    name = members["name"][0]
    if not valid_name(name, declared):
        return None
    for key in ARGUMENT_KEYS:
        if key in members:
            value, start, end = members[key]
            if isinstance(value, dict):
                return name, text[start:end]
            if isinstance(value, str):
                try:
                    return (name, value) if isinstance(loads(value), dict) and encodable(value) else None
                except (ValueError, RecursionError):
                    return None
            return None
    return name, "{}"


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
