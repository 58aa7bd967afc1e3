"""Incremental parsing of a streamed generation into reasoning, content and tool-call deltas.

The one rule: a delta is emitted only once no later text can change it, so concatenating the deltas
of a stream gives exactly what :func:`gymserve.parsers.parse_output` gives for the whole text (same
reasoning, content, calls and arguments), however the text was split. What that costs in latency:

- Reasoning in a span the model opened itself (it wrote ``<think>``) streams as it is generated,
  holding back only a suffix that may start ``</think>`` and trailing whitespace. A span the
  prompt pre-filled is held until ``</think>`` closes it (or the stream finishes): until then it
  may still turn out to be content (finish reason ``"stop"``, case RP-04); it is then emitted as
  one delta.
- Content streams as it arrives, except text that may be the start of a tag (``<tool``,
  ``[TOOL_``) and trailing whitespace (content is stripped), which wait for the next text.
- A tool call starts (``tool_call_start``: index, name) once its head ``{"name": "N",
  "arguments": {`` is written, and its arguments then stream as the model writes them
  (``tool_call_arguments`` deltas), by the commit rule of :mod:`gymserve.parsers.call_scan`.
  Call values that do not begin that way (keys in another order, arguments as a string) are
  emitted whole when their JSON closes. Tag text (``<tool_call>``) never reaches content unless
  the block is malformed, in which case it is content in the whole-text parse too.
- Bare-JSON formats (``qwen2_5_coder``, ``llama3_json``): a message starting with ``{``, ``[`` or a
  backtick waits only until the call head (or the value's end) decides whether it is a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gymserve.parsers.base import ReasoningParser, ToolCallParser, channel_scanner
from gymserve.parsers.call_scan import CallStart, ReasoningText, ScanEvent
from gymserve.parsers.json_scan import declared_tool_names
from gymserve.text import partial_tag_len
from gymserve.wire.ids import new_id

DeltaKind = Literal["reasoning", "content", "tool_call_start", "tool_call_arguments"]


@dataclass(frozen=True)
class Delta:
    """One streamed piece.

    ``kind == "reasoning" | "content"``: ``text`` is the new text. ``"tool_call_start"``: a new call
    ``index`` (0, 1, …) named ``name``. ``"tool_call_arguments"``: ``text`` extends call ``index``'s
    arguments string.
    """

    kind: DeltaKind
    text: str = ""
    index: int | None = None
    name: str | None = None


class _StrippedText:
    """Emits pieces of a text whose leading and trailing whitespace must end up stripped: leading
    whitespace is dropped, trailing whitespace held until non-blank text follows it."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""
        self.sent = 0  # characters emitted so far

    def push(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.started = True
        if not piece.strip():
            self.held += piece  # a long run of whitespace must not be re-stripped on every delta
            return ""
        combined = self.held + piece
        body = combined.rstrip()
        self.held = combined[len(body) :]
        self.sent += len(body)
        return body


class StreamingParser:
    """Parses a generation delta by delta; agrees with ``parse_output`` on the whole text.

    ``StreamingParser(tool_parser, reasoning_parser, prompt_tail, tools)``: the same arguments as
    :func:`~gymserve.parsers.parse_output` (no tools declared → no tool calls). Call
    :meth:`feed` with each text delta and :meth:`finish` once with the finish reason; both return
    a list of :class:`Delta`. After :meth:`finish`, ``reasoning_incomplete`` is set.
    """

    def __init__(
        self,
        tool_parser: ToolCallParser | None,
        reasoning_parser: ReasoningParser | None,
        prompt_tail: str = "",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self._tool_parser = tool_parser
        self._scanner = tool_parser.scanner(tools) if tool_parser and declared_tool_names(tools) else None
        # A channel format (harmony) parses the whole generation itself, reasoning included.
        self._channels = channel_scanner(tool_parser, reasoning_parser, tools)
        self._reasoning_parser = reasoning_parser
        self._prompt_tail = prompt_tail
        self._text = ""
        # Index into _text where the text after the reasoning span starts; None while undecided.
        self._rest_start: int | None = None if reasoning_parser is not None else 0
        self._fed = 0  # how much of the rest the tool-call scanner has been given
        self._content = _StrippedText()
        self._reasoning = _StrippedText()
        self._reasoning_fed = -1  # index into _text up to which reasoning has streamed (-1: none)
        self._close_absent_before = 0  # the reasoning close tag does not start before this index
        self._calls = 0
        self._finished = False
        self.reasoning_incomplete = False

    def new_call_id(self) -> str:
        """An id for the next call, in the tool-call format's form (``ToolCallParser.new_call_id``)."""
        return self._tool_parser.new_call_id() if self._tool_parser is not None else new_id("call")

    def feed(self, text_delta: str) -> list[Delta]:
        """Add generated text; returns the deltas it decided."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._text += text_delta
        out: list[Delta] = []
        if self._channels is not None:
            self._deltas(self._channels.feed(text_delta), out)
            return out
        if self._rest_start is None:
            assert self._reasoning_parser is not None
            rp, search_from = self._reasoning_parser, self._close_absent_before
            decided = rp.split_partial(self._text, self._prompt_tail, search_from)
            if decided is None:
                self._stream_reasoning(out)
                self._close_absent_before = max(0, len(self._text) - len(rp.close_tag) + 1) if rp.close_tag else 0
                return out
            reasoning, rest = decided
            self._start_rest(reasoning, rest, out)
        self._scan(final=False, out=out)
        return out

    def finish(self, finish_reason: str | None = "stop") -> list[Delta]:
        """End of generation; returns the remaining deltas."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out: list[Delta] = []
        if self._channels is not None:
            self._deltas(self._channels.finish(), out)
            self.reasoning_incomplete = (finish_reason or "stop") in ("length", "abort") and (
                self._channels.open_kind == "reasoning"
            )
            return out
        if self._rest_start is None:
            assert self._reasoning_parser is not None
            reasoning, rest, incomplete = self._reasoning_parser.split(
                self._text, self._prompt_tail, finish_reason or "stop"
            )
            self.reasoning_incomplete = incomplete
            self._start_rest(reasoning, rest, out)
        self._scan(final=True, out=out)
        return out

    def _stream_reasoning(self, out: list[Delta]) -> None:
        """Stream an open span that is reasoning however it ends, holding back a suffix that may
        start its close tag."""
        assert self._reasoning_parser is not None
        text = self._text
        body = self._reasoning_parser.open_body(text, self._prompt_tail, self._close_absent_before)
        if body is None:
            return
        start = max(body, self._reasoning_fed)
        close = self._reasoning_parser.close_tag
        end = len(text) - partial_tag_len(text, close, start)
        piece = self._reasoning.push(text[start:end])
        self._reasoning_fed = max(end, start)
        if piece:
            out.append(Delta("reasoning", piece))

    def _start_rest(self, reasoning: str | None, rest: str, out: list[Delta]) -> None:
        # Whatever streamed already is a prefix of the decided reasoning (the same text, stripped).
        if reasoning and len(reasoning) > self._reasoning.sent:
            out.append(Delta("reasoning", reasoning[self._reasoning.sent :]))
        self._rest_start = len(self._text) - len(rest)

    def _scan(self, final: bool, out: list[Delta]) -> None:
        assert self._rest_start is not None
        piece = self._text[self._rest_start + self._fed :]
        self._fed += len(piece)
        events: list[ScanEvent]
        if self._scanner is None:
            events = [piece]
        else:
            events = self._scanner.feed(piece)
            if final:
                events += self._scanner.finish()
        self._deltas(events, out)

    def _deltas(self, events: list[ScanEvent], out: list[Delta]) -> None:
        for event in events:
            if isinstance(event, ReasoningText):
                text = self._reasoning.push(event.text)
                if text:
                    out.append(Delta("reasoning", text))
            elif isinstance(event, str):
                text = self._content.push(event)
                if text:
                    out.append(Delta("content", text))
            elif isinstance(event, CallStart):
                out.append(Delta("tool_call_start", index=self._calls, name=event.name))
                self._calls += 1
            elif event.text:
                out.append(Delta("tool_call_arguments", event.text, index=self._calls - 1))


class ChatDeltas:
    """A :class:`StreamingParser` whose output is Chat Completions ``delta`` objects.

    ``ChatDeltas(parser, reasoning_fields)``: ``feed(text)`` / ``finish(reason)`` return a list of
    ``delta`` dicts in the OpenAI chunk format — ``{"content": ...}``; the reasoning text under
    each name in ``reasoning_fields`` (``reasoning_content`` and/or ``reasoning``, as vLLM spells
    them); a call's first delta ``{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}`` and then ``{"tool_calls": [{"index", "function": {"arguments": piece}}]}``.
    ``call_ids`` lists the ids given, in call order.
    """

    def __init__(self, parser: StreamingParser, reasoning_fields: tuple[str, ...]) -> None:
        self.parser = parser
        self.reasoning_fields = reasoning_fields
        self.call_ids: list[str] = []

    @property
    def reasoning_incomplete(self) -> bool:
        return self.parser.reasoning_incomplete

    def feed(self, text_delta: str) -> list[dict[str, Any]]:
        return [self._chat(d) for d in self.parser.feed(text_delta)]

    def finish(self, finish_reason: str | None = "stop") -> list[dict[str, Any]]:
        return [self._chat(d) for d in self.parser.finish(finish_reason)]

    def _chat(self, d: Delta) -> dict[str, Any]:
        if d.kind == "content":
            return {"content": d.text}
        if d.kind == "reasoning":
            return dict.fromkeys(self.reasoning_fields, d.text)
        if d.kind == "tool_call_start":
            self.call_ids.append(self.parser.new_call_id())
            return {
                "tool_calls": [
                    {
                        "index": d.index,
                        "id": self.call_ids[-1],
                        "type": "function",
                        "function": {"name": d.name, "arguments": ""},
                    }
                ]
            }
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}
