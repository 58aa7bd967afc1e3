"""The incremental tool-call scanner every JSON-based format shares.

A :class:`CallScanner` is fed generated text delta by delta and returns what it has decided:
content text, :class:`CallStart` (a new call and its name) and :class:`CallArguments` (more of
the current call's arguments). The whole-text parse feeds it the whole text at once, so streaming
and non-streaming agree by construction, however the text was split.

The rules, in the order the scanner applies them:

- **Regions.** Calls sit in a *region*: the text after a tag (``<tool_call>``, ``[TOOL_CALLS]``,
  ``<|python_tag|>``), or, for bare-JSON formats, a message that starts with ``{`` / ``[`` (or a
  ```json fence) — bare calls must name a *declared* tool, since ordinary JSON answers are
  common. A region holds call values (an object, or a list of objects) separated by whitespace or
  the format's separator, and ends at its close tag, the fence's close, the end of the text, or
  the first text that is not a call value (from there on, that text is content).
- **Commit.** A call object that begins ``{"name": "N", "arguments": {`` (``parameters`` too) is a
  call from that moment: ``N`` is emitted, then the arguments object is emitted as the model
  writes it — its own spelling, never re-serialized, never retracted. Its end is the matching
  brace, or the region's close tag if the model writes that first, or the end of the text (a
  generation cut by ``max_tokens``: the arguments are what was written; the response is
  incomplete).
- **Whole values.** Any other call value (keys in another order, arguments as a JSON string, a
  list) is judged when its JSON closes: a call (name and arguments emitted at once), or not.
- **Malformed.** A region whose first value is not a call is content verbatim, tag included, and
  scanning resumes right after the tag (a later good call still counts). After a call, text in
  the region that is not a call is content.
- **Holding back.** Text that may be the start of a tag, an unfinished call head, an undecided
  whole value, and whitespace before what may be a region's close are held until the text decides
  them; ``finish()`` decides everything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from gymserve.parsers.call_heads import HeadPattern, match_head, skip_literals
from gymserve.parsers.json_scan import Brackets, call_in_object, skip_ws, valid_name
from gymserve.parsers.step_scan import StepScanner
from gymserve.text import partial_tag_len


@dataclass(frozen=True)
class CallSyntax:
    """How a format marks its calls (see the module docstring for the rules applied).

    ``tag``: the literal that opens a region (None: no tagged regions). ``close_tag``: the literal
    that ends one (None: the region runs to the end of its values). ``separator``: the character
    between call values (``""``: whitespace only). ``one_value``: a region holds a single JSON
    value (Mistral). ``heads``: named-call head patterns (``call_heads``): a value may be a head
    then the arguments object (Mistral v11+ ``name[ARGS]{...}``, DeepSeek V3's
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` + a ```json block); ``call_tail``: literals
    that close such a call (each skipped when present, whitespace allowed before it).
    ``bare``: a message starting with ``{``/``[`` is a region of declared-tool calls. ``fence``: a
    message starting with a ```json (or bare ```) fence is such a region, ended by the fence.
    ``newline_separates``: with a ``separator``, a line break between two call objects separates
    them as well (Llama 3.x).
    """

    tag: str | None = None
    close_tag: str | None = None
    separator: str = ""
    one_value: bool = False
    heads: tuple[HeadPattern, ...] = ()
    call_tail: tuple[str, ...] = ()
    bare: bool = False
    fence: bool = False
    newline_separates: bool = False


@dataclass(frozen=True)
class CallStart:
    """A new tool call named ``name``; the :class:`CallArguments` after it are its arguments."""

    name: str


@dataclass(frozen=True)
class CallArguments:
    """``text`` extends the arguments string of the call started last."""

    text: str


@dataclass(frozen=True)
class ReasoningText:
    """``text`` extends the reasoning (only formats whose scanner parses the whole generation,
    such as harmony's, emit it)."""

    text: str


ScanEvent = str | CallStart | CallArguments | ReasoningText
"""What a scanner decides: a ``str`` is content (verbatim; the caller strips the whole), or a
call's start, or a piece of its arguments, or reasoning text."""

_HEAD = re.compile(
    r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\\x00-\x1f]|\\.)*")[ \t\n\r]*,'
    r'[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*(?=\{)'
)
_FENCE_HEAD = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?", re.I)
_FENCE_PARTIAL = re.compile(r"`{0,3}|```[ \t]*(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*\n?", re.I)
_FENCE = "```"
_SCALAR = re.compile(r"[-+0-9.eEa-zA-Z]+")


@dataclass
class _Region:
    start: int  # where its tag (or the bare message) starts: content restarts here if nothing was a call
    tag_len: int  # length of the tag that opened it (0 for a bare message)
    declared: set[str] | None  # names a call may have (None: any)
    close: str | None  # the literal that ends it
    calls: int = 0
    after_value: bool = False  # a value ended; a separator, the close or the end must follow


class CallScanner(StepScanner):
    """Scans one generation for calls in the format ``syntax`` describes.

    ``declared``: the request's declared function names (bare-JSON regions need them). Call
    :meth:`feed` with each text delta and :meth:`finish` once at the end; each returns the
    :class:`ScanEvent` list it decided. Concatenating every event of a run gives the same result
    however the text was split.
    """

    def __init__(self, syntax: CallSyntax, declared: set[str]) -> None:
        super().__init__()
        self.syntax = syntax
        self.declared = declared
        self.pos = 0  # text before it is decided; a failing region restarts content here
        self.cur = 0  # scan position inside the current value
        self.mode = "start" if (syntax.bare or syntax.fence) and declared else "content"
        self.region: _Region | None = None
        self.in_list = False
        self.list_expect = ""  # "element" or "comma"
        self.obj_start = 0
        self.brackets = Brackets()
        self.head_tried = False  # the head is matched once, when the object first nests
        self.args_emitted = 0  # arguments text before it has been emitted
        self.object_tail = True  # after the arguments, the rest of the call object follows
        self.tail_expect = ""  # after the arguments: "end", "key", "in_key", "colon", "value", "in_value"
        self.tail_ok = 0  # end of the last complete piece of the object's tail
        self._skipped = (-1, -1)  # (from, to) of the last whitespace skip, so waiting never rescans

    def _steps(self) -> dict[str, Callable[[], bool]]:
        return {
            "start": self._start,
            "content": self._content,
            "region": self._region_step,
            "list": self._list,
            "head": self._head,
            "args": self._args,
            "tail": self._tail,
            "call_tail": self._call_tail,
        }

    # ---------------------------------------------------------------------------- outside regions

    def _emit(self, text: str) -> None:
        if text:
            self._out.append(text)

    def _skip(self, start: int, any_space: bool = False) -> int:
        """Index of the first non-whitespace character at or after ``start``, resuming an earlier
        skip from the same ``start`` (the text only grows). ``any_space``: skip what ``str.strip``
        strips (the reasoning split and content stripping use it), not only JSON whitespace."""
        j = self._skipped[1] if self._skipped[0] == start else start
        t, n = self.text, len(self.text)
        if any_space:
            while j < n and t[j].isspace():
                j += 1
        else:
            j = skip_ws(t, j)
        self._skipped = (start, j)
        return j

    def _start(self) -> bool:
        """Message start of a bare-JSON format: is the message a region of calls?"""
        t, n = self.text, len(self.text)
        j = self._skip(0, any_space=True)
        if j == n and not self._final:
            return False
        self.mode = "content"
        if j < n and t[j] in "{[" and self.syntax.bare:
            self._open(0, 0, j, self.declared, None)
        elif j < n and t[j] == "`" and self.syntax.fence:
            if not self._final and _FENCE_PARTIAL.fullmatch(t, j):
                self.mode = "start"
                return False
            head = _FENCE_HEAD.match(t, j)
            value_at = self._skip(head.end(), any_space=True) if head else n
            if value_at == n and not self._final and head:
                self.mode = "start"
                return False
            if value_at < n and t[value_at] in "{[":
                self._open(0, 0, value_at, self.declared, _FENCE)
        return True

    def _content(self) -> bool:
        t, n, tag = self.text, len(self.text), self.syntax.tag
        if tag:
            j = t.find(tag, self.pos)
            if j >= 0:
                self._emit(t[self.pos : j])
                self._open(j, len(tag), j + len(tag), None, self.syntax.close_tag)
                return True
        end = n
        if tag and not self._final:
            end -= partial_tag_len(t, tag, self.pos)
        self._emit(t[self.pos : end])
        self.pos = max(self.pos, end)
        return False

    # ------------------------------------------------------------------------------------ regions

    def _open(self, start: int, tag_len: int, at: int, declared: set[str] | None, close: str | None) -> None:
        self.region = _Region(start, tag_len, declared, close)
        self.pos = at
        self.mode = "region"

    def _fail(self) -> bool:
        """What is left of the region is not a call: it becomes content (see module docstring)."""
        region = self.region
        assert region is not None
        if region.calls == 0:
            self._emit(self.text[region.start : region.start + region.tag_len])
            self.pos = region.start + region.tag_len
        self.region, self.in_list, self.mode = None, False, "content"
        return True

    def _close_region(self, at: int) -> bool:
        if self.region is not None and self.region.calls == 0:
            return self._fail()
        self.region, self.in_list, self.mode, self.pos = None, False, "content", at
        return True

    def _region_step(self) -> bool:
        region = self.region
        assert region is not None
        t, n = self.text, len(self.text)
        j = self._skip(self.pos)
        close = region.close
        if j == n:
            return self._close_region(n) if self._final else False
        if close and t.startswith(close, j):
            return self._close_region(j + len(close))
        if close and not self._final and n - j < len(close) and close.startswith(t[j:]):
            return False
        if region.after_value:
            if self.syntax.one_value:
                return self._close_region(self.pos)
            if self.syntax.separator:
                if t[j] == self.syntax.separator:
                    self.pos, region.after_value = j + 1, False
                    return True
                # A line break separates calls too where the format says so (Llama 3.x writes one
                # call per line as often as it writes ``;``).
                if not (self.syntax.newline_separates and "\n" in t[self.pos : j] and t[j] == "{"):
                    return self._fail()
            if t[j] not in "{[" and not self.syntax.heads:
                return self._fail()
            region.after_value = False
        if t[j] == "[":
            self.in_list, self.list_expect, self.cur, self.mode = True, "element", j + 1, "list"
            return True
        if t[j] == "{":
            return self._open_object(j)
        if self.syntax.heads:
            return self._named_call(j)
        return self._fail()

    def _value_done(self, end: int) -> bool:
        self.pos = self.cur = end
        if self.in_list:
            self.list_expect, self.mode = "comma", "list"
        else:
            assert self.region is not None
            self.region.after_value, self.mode = True, "region"
        return True

    def _list(self) -> bool:
        t, n = self.text, len(self.text)
        j = self._skip(self.cur)
        if j == n:
            return self._fail() if self._final else False
        if self.list_expect == "comma":
            if t[j] == ",":
                self.cur, self.list_expect = j + 1, "element"
                return True
            if t[j] == "]":
                self.in_list = False
                return self._value_done(j + 1)
            return self._fail()
        if t[j] != "{":  # an empty list, or an element that is not an object, is not a call
            return self._fail()
        return self._open_object(j)

    # ------------------------------------------------------------------------------------ a call

    def _open_object(self, at: int) -> bool:
        self.obj_start, self.cur, self.brackets, self.mode = at, at, Brackets(), "head"
        self.head_tried = False
        return True

    def _head(self) -> bool:
        """A call object before its head is known: commit on the head, or judge the whole value.

        The head ``{"name": "N", "arguments": {`` ends where the object first nests, so the
        head pattern is tried once, there (a long name is not rescanned on every delta)."""
        region = self.region
        assert region is not None
        t = self.text
        end, outcome = self.brackets.advance(t, self.cur, region.close, 0 if self.head_tried else 2)
        self.cur = end
        if outcome == "deeper":
            self.head_tried = True
            head = _HEAD.match(t, self.obj_start)
            if head is not None and head.end() == end - 1:
                try:
                    name = json.loads(head.group(1))
                except ValueError:
                    name = ""
                if valid_name(name, region.declared):
                    return self._commit(name, end - 1, object_tail=True)
            return True
        if outcome == "closed":
            call = call_in_object(t[self.obj_start : end], region.declared)
            if call is None:
                return self._fail()
            region.calls += 1
            self._out += [CallStart(call[0]), CallArguments(call[1])]
            return self._value_done(end)
        if outcome == "stop" or self._final:
            return self._fail()
        return False

    def _commit(self, name: str, args_at: int, object_tail: bool) -> bool:
        assert self.region is not None
        self.region.calls += 1
        self._out.append(CallStart(name))
        self.cur = self.args_emitted = args_at
        self.brackets, self.object_tail, self.mode = Brackets(), object_tail, "args"
        return True

    def _emit_arguments(self, end: int) -> None:
        if end > self.args_emitted:
            self._out.append(CallArguments(self.text[self.args_emitted : end]))
            self.args_emitted = end

    def _args(self) -> bool:
        """Inside a committed call's arguments: emit them as they come."""
        assert self.region is not None
        end, outcome = self.brackets.advance(self.text, self.cur, self.region.close)
        self._emit_arguments(end)
        self.cur = end
        if outcome == "closed":
            if not self.object_tail:
                if self.syntax.call_tail:
                    self.mode = "call_tail"
                    return True
                return self._value_done(end)
            self.tail_expect, self.tail_ok, self.mode = "end", end, "tail"
            return True
        if outcome == "stop" or self._final:
            # Cut inside the arguments: the call keeps what was written; the region's close (if
            # any) is next, and a list this call was in cannot go on.
            self.in_list = False
            return self._value_done(end)
        return False

    def _tail(self) -> bool:
        """After a committed call's arguments: the rest of its object — ``}``, or more members
        (``, "key": value``, skipped as call syntax). Anything else ends the call where its valid
        part ends, and the region goes on from there (so that text is content, never lost)."""
        assert self.region is not None
        t, n, expect = self.text, len(self.text), self.tail_expect
        if expect in ("in_key", "in_value"):
            end, outcome = self.brackets.advance(t, self.cur, self.region.close)
            self.cur = end
            if outcome == "closed":
                self.tail_expect = "colon" if expect == "in_key" else "end"
                if expect == "in_value":
                    self.tail_ok = end
                return True
            if outcome == "stop" or self._final:
                return self._value_done(self.tail_ok)
            return False
        j = self._skip(self.cur)
        if j == n:
            return self._value_done(self.tail_ok) if self._final else False
        ch = t[j]
        if expect == "end" and ch in ",}":
            if ch == "}":
                return self._value_done(j + 1)
            self.cur, self.tail_expect = j + 1, "key"
            return True
        if (expect == "key" and ch == '"') or (expect == "value" and ch in '{["'):
            self.cur, self.brackets = j, Brackets()
            self.tail_expect = "in_key" if expect == "key" else "in_value"
            return True
        if expect == "colon" and ch == ":":
            self.cur, self.tail_expect = j + 1, "value"
            return True
        if expect == "value":
            scalar = _SCALAR.match(t, j)
            if scalar is not None and scalar.end() == n and not self._final:
                return False  # the number or literal may go on
            if scalar is not None:
                self.cur = self.tail_ok = scalar.end()
                self.tail_expect = "end"
                return True
        return self._value_done(self.tail_ok)

    def _named_call(self, at: int) -> bool:
        """A named-call head (``CallSyntax.heads``): committed once ``{`` follows it."""
        outcome, name, args_at = match_head(self.text, at, self.syntax.heads, self._final)
        if outcome == "wait":
            return False
        if outcome == "fail" or not valid_name(name, self.region.declared if self.region else None):
            return self._fail()
        assert name is not None
        return self._commit(name, args_at, object_tail=False)

    def _call_tail(self) -> bool:
        """After a named call's arguments: its closing literals, when the model wrote them."""
        end = skip_literals(self.text, self.cur, self.syntax.call_tail, self._final)
        if end is None:
            return False
        return self._value_done(end)
