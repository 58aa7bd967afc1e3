"""Tool-call and reasoning parsers: generated text → reasoning, content, tool calls.

``parse_output`` parses a whole generation; ``StreamingParser`` parses one delta by delta and
always agrees with it. Parsers are chosen by name (``get_tool_call_parser("hermes")``,
``get_reasoning_parser("qwen3")``; the names are those of ``TOOL_CALL_PARSERS`` /
``REASONING_PARSERS``) or, for tool calls, inferred: ``tool_call_parser_for("auto", ...)``.
"""

from __future__ import annotations

from typing import Any

from gymserve.parsers.base import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ParsedOutput,
    ParsedToolCall,
    ReasoningParser,
    ToolCallParser,
    channel_scanner,
    collect_all,
    get_reasoning_parser,
    get_tool_call_parser,
    reasoning_parser_names,
    register,
    tool_call_parser_names,
)
from gymserve.parsers.json_scan import declared_tool_names
from gymserve.parsers.reasoning import ThinkReasoningParser
from gymserve.parsers.streaming import ChatDeltas, Delta, StreamingParser
from gymserve.parsers.tool_calls import infer_tool_call_parser, tool_call_parser_for

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChatDeltas",
    "Delta",
    "ParsedOutput",
    "ParsedToolCall",
    "ReasoningParser",
    "StreamingParser",
    "ThinkReasoningParser",
    "ToolCallParser",
    "declared_tool_names",
    "get_reasoning_parser",
    "get_tool_call_parser",
    "infer_tool_call_parser",
    "parse_output",
    "reasoning_parser_names",
    "register",
    "tool_call_parser_for",
    "tool_call_parser_names",
]


def parse_output(
    text: str,
    *,
    prompt_tail: str = "",
    finish_reason: str | None = "stop",
    tools: list[dict[str, Any]] | None = None,
    tool_parser: ToolCallParser | None = None,
    reasoning_parser: ReasoningParser | None = None,
) -> ParsedOutput:
    """Split a finished generation into reasoning, content and tool calls.

    ``prompt_tail``: the end of the real rendered prompt ("" when unknown, see
    :class:`ThinkReasoningParser`); ``finish_reason``: the engine's (``"length"`` keeps an unclosed
    reasoning span as reasoning, anything else makes it content); ``tools``: the request's tool list
    (chat or Responses form).

    Reasoning is split first; tool calls are looked for only in the text after the reasoning span,
    so a call drafted while thinking is never executed and stays verbatim in the reasoning (case
    TP-02). No tools declared (``tools`` None or empty, e.g. ``tool_choice="none"`` callers pass
    None) or no tool parser → no tool calls, whatever the text holds: a call to an undeclared tool
    cannot be executed, and vLLM also runs no tool parser then; tag text stays in content.
    Content is stripped of leading/trailing whitespace (None when empty). Never raises on model
    output.

    A parser of a format that structures the whole generation in channels (harmony: either of the
    pair, ``openai`` / ``openai_gptoss``) parses everything at once instead (``channel_scanner``):
    reasoning, content and, with tools declared, calls.
    """
    channels = channel_scanner(tool_parser, reasoning_parser, tools)
    if channels is not None:
        reasoning, content, calls = collect_all(channels.feed(text) + channels.finish())
        incomplete = (finish_reason or "stop") in ("length", "abort") and channels.open_kind == "reasoning"
        return ParsedOutput(reasoning=reasoning, content=content, tool_calls=calls, reasoning_incomplete=incomplete)
    if reasoning_parser is not None:
        reasoning, rest, incomplete = reasoning_parser.split(text, prompt_tail, finish_reason or "stop")
    else:
        reasoning, rest, incomplete = None, text, False
    if tool_parser is not None and declared_tool_names(tools):
        content, calls = tool_parser.parse(rest, tools)
    else:
        content, calls = rest.strip() or None, []
    return ParsedOutput(reasoning=reasoning, content=content, tool_calls=calls, reasoning_incomplete=incomplete)
