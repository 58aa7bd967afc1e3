"""gpt-oss's harmony format: a generation is a sequence of channel messages, parsed incrementally.

Source: OpenAI's harmony format guide and the ``openai-harmony`` package (its ``StreamableParser``
is the reference parser); vLLM's names for the pair: ``--tool-call-parser openai`` and
``--reasoning-parser openai_gptoss``. The format, as generated text decoded with its special
tokens (the prompt ends with ``<|start|>assistant``, so the first header has no role)::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

The rules :class:`HarmonyScanner` applies:

- **Messages.** A header runs to ``<|message|>``; the body runs to ``<|end|>`` (more messages may
  follow, each opened by ``<|start|>`` and a role), ``<|call|>`` (a tool call ends the turn),
  ``<|return|>`` (the final answer ends it), a ``<|start|>`` the model wrote without closing the
  message, or the end of the text (the text leaves out the stop token that ended the generation).
- **Headers.** ``<|channel|>NAME`` names the channel; ``to=RECIPIENT`` may stand before the channel
  (right after the role) or after it; a content type (``json`` or ``<|constrain|>json``) may close
  the header. A recipient ``functions.NAME`` is a call of ``NAME``; any other recipient (a built-in
  tool such as ``browser.search`` or ``python``) is a call of that name as written; ``assistant``,
  ``user`` and ``all`` address no tool.
- **What a message is.** Any message with a tool recipient is a tool call: its body is the
  arguments, streamed as they are written (``"{}"`` when empty). Otherwise the ``analysis``
  channel is reasoning, and ``final``, ``commentary`` (a preamble meant for the user) or no channel
  are content. Several reasoning (or content) messages are joined by a blank line.
- **Not harmony.** A generation that does not start with a header (the model ignored the format)
  is content. A header cut off by the end of the text is dropped (format syntax, never shown);
  stray text between messages is content. With calls not parsed (no tools declared), a call's
  arguments are content, so nothing is lost.

The same scanner parses whole texts and streams, so the two agree however the text is split.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gymserve.parsers.base import ReasoningParser, ToolCallParser, collect_all
from gymserve.parsers.call_scan import CallArguments, CallStart, ReasoningText, ScanEvent
from gymserve.parsers.json_scan import valid_name
from gymserve.parsers.step_scan import StepScanner
from gymserve.text import partial_tag_len

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN, CALL, RETURN = "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"
HISTORY_TURN_END = END
"""What a turn ends with in history: ``<|return|>`` is rendered as ``<|end|>`` (harmony guide,
"Message format"), so the prefix splice counts ``<|end|>`` as a turn end for this format."""

_BODY_ENDS = (END, CALL, RETURN, START)
_HEADER_OPENERS = (CHANNEL, CONSTRAIN, MESSAGE, "to=", " to=")
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"(?:^|\s)to=([^\s<]+)")
_NO_TOOL = frozenset({"assistant", "user", "all", "system", "developer"})


def parse_header(header: str) -> tuple[str | None, str | None]:
    """``(channel, tool name)`` of a harmony message header (the text between ``<|start|>`` and
    ``<|message|>``, role included or not): the channel, or None; the called tool's name, or None
    when the recipient is absent or addresses no tool (see the module docstring)."""
    channel = _CHANNEL_RE.search(header)
    recipient = _RECIPIENT_RE.search(header)
    name = recipient.group(1) if recipient else None
    if name is not None:
        name = name.removeprefix("functions.") if name.startswith("functions.") else name
        if name in _NO_TOOL or not name:
            name = None
    return (channel.group(1) if channel else None), name


class HarmonyScanner(StepScanner):
    """Scans one harmony generation (module docstring): :meth:`feed` each text delta, then
    :meth:`finish`; each returns :data:`~gymserve.parsers.call_scan.ScanEvent` objects (content
    strings, :class:`ReasoningText`, :class:`CallStart` / :class:`CallArguments`).

    ``parse_calls``: messages to a tool are calls (False: their bodies are content). After
    :meth:`finish`, ``open_kind`` is what the text ended inside: ``"reasoning"``, ``"content"``,
    ``"call"``, ``"header"`` or None (between messages).
    """

    def __init__(self, parse_calls: bool) -> None:
        super().__init__()
        self.parse_calls = parse_calls
        self.pos = 0
        self.mode = "first"  # first | header | body | between
        self.kind: str | None = None  # the current body's: reasoning | content | call
        self.body_len = 0
        self.seen = {"reasoning": False, "content": False}
        self.open_kind: str | None = None

    def finish(self) -> list[ScanEvent]:
        """The text is complete; returns the remaining events."""
        out = super().finish()
        self.open_kind = self.kind if self.mode == "body" else ("header" if self.mode == "header" else None)
        if self.mode == "body":
            self._end_body()
            out += self._out
        return out

    # ---------------------------------------------------------------------------------- states

    def _steps(self) -> dict[str, Callable[[], bool]]:
        return {"first": self._first, "header": self._header, "body": self._body, "between": self._between}

    def _undecided(self, rest: str, options: tuple[str, ...]) -> bool:
        """``rest`` may still grow into one of ``options`` (so the scanner waits)."""
        return not self._final and any(o.startswith(rest) for o in options)

    def _first(self) -> bool:
        """Generation start: a header (the prompt wrote ``<|start|>assistant``) or plain text."""
        rest = self.text[self.pos :].lstrip()
        if not rest or self._undecided(rest, _HEADER_OPENERS):
            if self._final:
                self.mode = "between"
                return True
            return False
        if rest.startswith(_HEADER_OPENERS):
            self.mode = "header"
        else:
            self._open_body("content")
        return True

    def _between(self) -> bool:
        """After a message: ``<|start|>`` opens the next; other text is content."""
        t = self.text
        j = len(t) - len(t[self.pos :].lstrip())
        rest = t[j:]
        if not rest or self._undecided(rest, (START,)):
            return False
        if rest.startswith(START):
            self.pos, self.mode = j + len(START), "header"
        else:
            self._open_body("content")
        return True

    def _header(self) -> bool:
        t = self.text
        end = t.find(MESSAGE, self.pos)
        broken = min((i for i in (t.find(m, self.pos) for m in (END, START, CALL, RETURN)) if i >= 0), default=-1)
        if end < 0 or 0 <= broken < end:
            if broken >= 0:  # a header closed by a message end: no body; resume there
                self.pos, self.mode = broken, "body"
                self.kind = "dropped"
                return True
            if self._final:
                self.mode = "header"
            return False
        channel, tool = parse_header(t[self.pos : end])
        self.pos = end + len(MESSAGE)
        if tool is not None and self.parse_calls and valid_name(tool, None):
            self._out.append(CallStart(tool))
            self._open_body("call")
        else:
            self._open_body("reasoning" if channel == "analysis" else "content")
        return True

    def _open_body(self, kind: str) -> None:
        if kind in self.seen and self.seen[kind]:
            self._emit(kind, "\n\n")
        self.kind, self.mode, self.body_len = kind, "body", 0

    def _body(self) -> bool:
        t, n = self.text, len(self.text)
        ends = [(i, m) for m in _BODY_ENDS if (i := t.find(m, self.pos)) >= 0]
        if ends:
            i, marker = min(ends)
            self._emit(self.kind, t[self.pos : i])
            self._end_body()
            self.pos = i + len(marker)
            self.mode = "header" if marker == START else "between"
            return True
        hold = 0 if self._final else max(partial_tag_len(t, m, self.pos) for m in _BODY_ENDS)
        self._emit(self.kind, t[self.pos : n - hold])
        self.pos = n - hold
        return False

    def _emit(self, kind: str | None, text: str) -> None:
        if not text or kind == "dropped":
            return
        self.body_len += len(text)
        if kind == "call":
            self._out.append(CallArguments(text))
            return
        if kind == "reasoning":
            self._out.append(ReasoningText(text))
        else:
            self._out.append(text)
        if text.strip() and kind in self.seen:
            self.seen[kind] = True

    def _end_body(self) -> None:
        if self.kind == "call" and self.body_len == 0:
            self._out.append(CallArguments("{}"))
        self.kind = None


class _Harmony:
    channels = True

    def channel_scanner(self, parse_calls: bool) -> HarmonyScanner:
        """A fresh :class:`HarmonyScanner` for one generation."""
        return HarmonyScanner(parse_calls)

    history_turn_end = HISTORY_TURN_END


class HarmonyToolCallParser(_Harmony, ToolCallParser):
    """gpt-oss tool calls: messages with a tool recipient (``to=functions.NAME``) in the harmony
    format (module docstring). The whole generation is parsed by :class:`HarmonyScanner`, reasoning
    and content included, whichever of the pair is configured. Source: the harmony guide,
    "Receiving tool calls"; vLLM ``--tool-call-parser openai``."""

    name = "openai"

    def adjust_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """``skip_special_tokens: false``: the raw text needs harmony's framing tokens."""
        body = super().adjust_request(body)
        body.setdefault("skip_special_tokens", False)
        return body

    def parse_final(self, text: str, tools: list[dict[str, Any]] | None) -> list[ScanEvent]:
        scanner = HarmonyScanner(parse_calls=True)
        return [e for e in scanner.feed(text) + scanner.finish() if not isinstance(e, ReasoningText)]


class HarmonyReasoningParser(_Harmony, ReasoningParser):
    """gpt-oss reasoning: the ``analysis`` channel of the harmony format (module docstring).
    Source: the harmony guide, "Reasoning"; vLLM ``--reasoning-parser openai_gptoss``."""

    name = "openai_gptoss"

    def split(self, text: str, prompt_tail: str, finish_reason: str) -> tuple[str | None, str, bool]:
        """``(reasoning, content, incomplete)``: the analysis messages joined, and the content
        messages joined (not a suffix of ``text``: harmony interleaves them; the parsers' own
        entry points use :meth:`channel_scanner` instead)."""
        scanner = HarmonyScanner(parse_calls=False)
        reasoning, content, _ = collect_all(scanner.feed(text) + scanner.finish())
        incomplete = finish_reason in ("length", "abort") and scanner.open_kind == "reasoning"
        return reasoning, content or "", incomplete
