"""Qwen3-Coder's XML tool calls, parsed incrementally::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Source: the Qwen3-Coder chat template (it renders calls this way and asks the model for it) and
vLLM's ``--tool-call-parser qwen3_coder``, whose rules are followed:

- A parameter's value is the text between ``<parameter=KEY>`` and ``</parameter>``, without one
  leading and one trailing newline. A ``</parameter>`` the model left out ends at the next
  ``<parameter=`` or ``</function>`` that starts a line; ``</tool_call>`` may be left out too.
- Values are typed by the tool's JSON schema (the model writes every value as text): ``string``
  (and a parameter the schema does not list) stays text; ``integer`` / ``number`` are numbers;
  ``boolean`` is ``true`` / ``false``; ``object`` / ``array`` are JSON (or a Python literal, which
  the model sometimes writes); ``null`` / ``None`` is null for a non-string type. A value that
  does not convert stays text.
- The arguments are the JSON object of the parameters in the order written (the first of
  duplicate keys wins), ``{"key": value, ...}`` as ``json.dumps`` writes it; each parameter is
  streamed once its value is complete.
- Text outside ``<tool_call>`` blocks is content; a block that does not start with
  ``<function=NAME>`` is content verbatim, tag included, and scanning resumes after its tag.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from typing import Any

from gymserve.parsers.base import ToolCallParser
from gymserve.parsers.call_scan import CallArguments, CallStart
from gymserve.parsers.json_scan import valid_name
from gymserve.parsers.step_scan import StepScanner
from gymserve.text import partial_tag_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME_MAX = 256


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``{function name: {parameter: schema}}`` of a chat-form or Responses-form tool list."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        nested = tool.get("function")
        fn: dict[str, Any] = nested if isinstance(nested, dict) else tool
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return ["string"]
    kind = schema.get("type")
    if isinstance(kind, list):
        return [str(k).lower() for k in kind]
    if isinstance(kind, str):
        return [kind.lower()]
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list):
        return [t for o in options for t in _types(o)]
    return ["string"]


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its ``schema`` asks for (module docstring)."""
    types = _types(schema)
    main = next((t for t in types if t != "null"), "null")
    if text.strip().lower() in ("null", "none") and ("null" in types or main != "string"):
        return None
    if main in ("string", "str", "text", "enum"):
        return text
    stripped = text.strip()
    if main.startswith(("int", "uint", "long", "short")):
        try:
            return int(stripped)
        except ValueError:
            return text
    if main.startswith(("num", "float", "double")):
        try:
            number = float(stripped)
        except ValueError:
            return text
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    if main in ("boolean", "bool"):
        return {"true": True, "false": False}.get(stripped.lower(), text)
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(stripped)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return text
    return value


class XmlCallScanner(StepScanner):
    """Scans one generation for Qwen3-Coder XML calls (module docstring); ``feed`` / ``finish``
    return :data:`~gymserve.parsers.call_scan.ScanEvent` lists whose concatenation does not depend
    on how the text was split. ``tools``: the request's tools (their schemas type the values)."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        super().__init__()
        self.schemas = tool_schemas(tools)
        self.pos = 0
        self.mode = "content"  # content | function | params | value
        self.block = 0  # where the current <tool_call> starts (content restarts there if it fails)
        self.params: dict[str, Any] = {}
        self.schema: dict[str, Any] = {}
        self.key = ""
        self.searched = 0

    def _steps(self) -> dict[str, Callable[[], bool]]:
        return {"content": self._content, "function": self._function, "params": self._params, "value": self._value}

    def _content(self) -> bool:
        t = self.text
        j = t.find(OPEN, self.pos)
        if j >= 0:
            self._text(t[self.pos : j])
            self.block, self.pos, self.mode = j, j + len(OPEN), "function"
            return True
        end = len(t) if self._final else len(t) - partial_tag_len(t, OPEN, self.pos)
        self._text(t[self.pos : end])
        self.pos = max(self.pos, end)
        return False

    def _text(self, text: str) -> None:
        if text:
            self._out.append(text)

    def _fail(self) -> bool:
        """The block is not a call: its tag is content, and scanning resumes after it."""
        self._text(OPEN)
        self.pos, self.mode = self.block + len(OPEN), "content"
        return True

    def _skip_ws(self) -> int:
        t, i = self.text, self.pos
        while i < len(t) and t[i].isspace():
            i += 1
        return i

    def _function(self) -> bool:
        """After ``<tool_call>``: ``<function=NAME>`` opens the call."""
        t, i = self.text, self._skip_ws()
        rest = t[i:]
        if not self._final and (not rest or FUNCTION.startswith(rest)):
            return False
        if not rest.startswith(FUNCTION):
            return self._fail()
        end = t.find(">", i + len(FUNCTION), i + len(FUNCTION) + _NAME_MAX + 1)
        if end < 0:
            return self._fail() if self._final or len(rest) > len(FUNCTION) + _NAME_MAX else False
        name = t[i + len(FUNCTION) : end].strip()
        if not valid_name(name, None) or "<" in name or "\n" in name:
            return self._fail()
        self._out += [CallStart(name), CallArguments("{")]
        self.params, self.schema = {}, self.schemas.get(name, {})
        self.pos, self.mode = end + 1, "params"
        return True

    def _params(self) -> bool:
        """Inside the function: the next ``<parameter=KEY>``, or its end."""
        t, i = self.text, self._skip_ws()
        rest = t[i:]
        if rest.startswith(PARAMETER):
            end = t.find(">", i + len(PARAMETER), i + len(PARAMETER) + _NAME_MAX + 1)
            if end >= 0:
                self.key, self.mode = t[i + len(PARAMETER) : end].strip(), "value"
                self.pos = end + 1
                return True
            if not self._final and len(rest) <= len(PARAMETER) + _NAME_MAX:
                return False
        elif not self._final and (not rest or any(m.startswith(rest) for m in (PARAMETER, FUNCTION_END, CLOSE))):
            return False
        # </function>, </tool_call>, the end of the text, or anything else: the call ends here.
        self._out.append(CallArguments("}"))
        for marker in (FUNCTION_END, CLOSE):
            i = self._skip_ws_from(i)
            if t.startswith(marker, i):
                i += len(marker)
        self.pos, self.mode = i, "content"
        return True

    def _skip_ws_from(self, i: int) -> int:
        t = self.text
        while i < len(t) and t[i].isspace():
            i += 1
        return i

    def _value(self) -> bool:
        """A parameter's value, up to ``</parameter>`` (or a line-starting ``<parameter=`` /
        ``</function>`` when the model left the end tag out)."""
        t = self.text
        # The end markers do not start before `searched` (a long value is not rescanned per delta).
        start = max(self.pos, self.searched)
        ends = [(t.find(PARAMETER_END, start), len(PARAMETER_END))]
        ends += [(t.find("\n" + m, start), 1) for m in (PARAMETER, FUNCTION_END)]
        found = [(i, n) for i, n in ends if i >= 0]
        if found:
            i, skip = min(found)
            self.searched = 0
            self._param_done(t[self.pos : i])
            self.pos, self.mode = i + skip, "params"
            return True
        if not self._final:
            self.searched = max(start, len(t) - len(PARAMETER_END))
            return False
        self._param_done(t[self.pos :])
        self.pos, self.mode = len(t), "params"
        return True

    def _param_done(self, raw: str) -> None:
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        if self.key in self.params or not self.key:
            return
        self.params[self.key] = convert_value(value, self.schema.get(self.key, {"type": "string"}))
        sep = ", " if len(self.params) > 1 else ""
        piece = json.dumps(self.key, ensure_ascii=False) + ": " + json.dumps(self.params[self.key], ensure_ascii=False)
        self._out.append(CallArguments(sep + piece))


class Qwen3CoderToolCallParser(ToolCallParser):
    """Qwen3-Coder's XML tool calls (``<tool_call><function=NAME><parameter=K>V</parameter>
    </function></tool_call>``, see :mod:`gymserve.parsers.xml_calls`). Source: the Qwen3-Coder
    chat template; vLLM ``--tool-call-parser qwen3_coder``. The tags are explicit, so any function
    name is accepted; the declared tools' schemas type the parameter values."""

    name = "qwen3_coder"

    def scanner(self, tools: list[dict[str, Any]] | None) -> XmlCallScanner:  # type: ignore[override]
        return XmlCallScanner(tools)
