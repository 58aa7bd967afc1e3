"""Parsing on gymserve's side for chat servers started without a tool-call or reasoning parser.

Such a server returns the model's raw text (``<think>…</think>``, ``<tool_call>…</tool_call>``) as
``content``. The chat backend's ``tool_call_parser`` / ``reasoning_parser`` options run the local
engine's parsers over it: :func:`apply_parsers` on a whole completion, :class:`ParsedChunkStream`
on a stream, chunk by chunk as it arrives (the same scanner, so the two agree). The rules, as for a
whole completion: tool calls are looked for only when the request offered tools and the server
sent none; reasoning only when the server sent no reasoning field.
"""

from __future__ import annotations

from typing import Any

from gymserve.parsers import ChatDeltas, ReasoningParser, StreamingParser, ToolCallParser, parse_output
from gymserve.wire.ids import new_id
from gymserve.wire.reasoning import REASONING_FIELDS  # the chat backend fills both names (case CR-01)


def apply_parsers(
    choice: dict[str, Any],
    tools: list[dict[str, Any]] | None,
    tool_parser: ToolCallParser | None,
    reasoning_parser: ReasoningParser | None,
) -> None:
    """Parse ``choice["message"]["content"]`` in place: reasoning into both reasoning fields, tool
    calls into ``tool_calls`` (``finish_reason`` ``stop`` becomes ``tool_calls``), the rest back
    into ``content``."""
    msg = choice["message"]
    text = msg.get("content")
    tools = tools if not msg.get("tool_calls") else None
    # A channel format (harmony) frames reasoning and content too, so it runs with no tools to call.
    tool_parser = tool_parser if tools or getattr(tool_parser, "channels", False) else None
    reasoning_parser = reasoning_parser if not any(msg.get(k) for k in REASONING_FIELDS) else None
    if not isinstance(text, str) or not text or (tool_parser is None and reasoning_parser is None):
        return
    parsed = parse_output(
        text,
        prompt_tail="",
        finish_reason=choice.get("finish_reason") or "stop",
        tools=tools,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )
    msg["content"] = parsed.content
    if parsed.reasoning is not None:
        msg.update(dict.fromkeys(REASONING_FIELDS, parsed.reasoning))
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {
                "id": tool_parser.new_call_id() if tool_parser else new_id("call"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in parsed.tool_calls
        ]
        if choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"


class ParsedChunkStream:
    """Re-parses a chat chunk stream's ``content`` as it arrives.

    ``ParsedChunkStream(tools, tool_parser, reasoning_parser)``; :meth:`process` takes one
    upstream chunk (dict) and returns the chunks to send instead: the chunk's other fields first
    (role, fields the server parsed itself), then one chunk per parsed delta, then — on the
    choice's ``finish_reason`` — the parser's last deltas and the finish chunk (``stop`` becomes
    ``tool_calls`` when calls were found). Each choice ``index`` has its own parser; a choice whose
    server already sent tool calls (or reasoning) keeps those and is not parsed for them again.
    """

    def __init__(
        self,
        tools: list[dict[str, Any]] | None,
        tool_parser: ToolCallParser | None,
        reasoning_parser: ReasoningParser | None,
    ) -> None:
        self.tools = tools
        self.tool_parser = tool_parser if tools or getattr(tool_parser, "channels", False) else None
        self.reasoning_parser = reasoning_parser
        self._parsers: dict[int, ChatDeltas] = {}
        self._upstream: dict[int, set[str]] = {}  # per choice: "tool_calls" / "reasoning" the server sent

    def _parser(self, index: int) -> ChatDeltas:
        if index not in self._parsers:
            seen = self._upstream.get(index, set())
            self._parsers[index] = ChatDeltas(
                StreamingParser(
                    self.tool_parser,
                    None if "reasoning" in seen else self.reasoning_parser,
                    "",
                    None if "tool_calls" in seen else self.tools,
                ),
                REASONING_FIELDS,
            )
        return self._parsers[index]

    def process(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return [chunk]  # a usage-only chunk, or something this does not understand: unchanged
        out: list[dict[str, Any]] = []
        for choice in choices:
            if not isinstance(choice, dict):
                return [chunk]
            index = choice.get("index", 0)
            delta = dict(choice.get("delta") or {})
            seen = self._upstream.setdefault(index, set())
            if delta.get("tool_calls"):
                seen.add("tool_calls")
            if any(delta.get(k) for k in REASONING_FIELDS):
                seen.add("reasoning")
            content = delta.pop("content", None)
            if delta:  # the role, or fields the server parsed itself
                out.append(_with_choice(chunk, index, delta, None))
            pieces = self._parser(index).feed(content) if isinstance(content, str) and content else []
            finish = choice.get("finish_reason")
            if finish:
                parser = self._parser(index)
                pieces += parser.finish(finish)
                if finish == "stop" and parser.call_ids:
                    finish = "tool_calls"
            out += [_with_choice(chunk, index, piece, None) for piece in pieces]
            extra = {k: v for k, v in choice.items() if k not in ("index", "delta", "finish_reason") and v is not None}
            if finish or extra:  # log-probs ride on a chunk of their own, after the text they score
                out.append(_with_choice(chunk, index, {}, finish, **extra))
        if chunk.get("usage") is not None:
            if not out:
                out.append({**{k: v for k, v in chunk.items() if k != "choices"}, "choices": []})
            out[-1]["usage"] = chunk["usage"]
        return out


def _with_choice(
    chunk: dict[str, Any], index: int, delta: dict[str, Any], finish: str | None, **extra: Any
) -> dict[str, Any]:
    head = {k: v for k, v in chunk.items() if k not in ("choices", "usage")}
    return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, **extra}]}
