"""Parser interfaces and registries: tool-call parsers and reasoning parsers, chosen by name.

The registries (``TOOL_CALL_PARSERS``, ``REASONING_PARSERS``) live in ``gymserve.registry`` with
the engines' and backends' (re-exported here); config validation, CLI help and error messages read their
names. One registry serves two users: the local engine (parsing what it generated) and the chat backend
(parsing raw text from chat servers that run no parser). Names follow ``vllm serve``'s
``--tool-call-parser`` / ``--reasoning-parser`` spellings where one exists.

Both kinds of parser are pure functions of their inputs and never raise on model output: text that
does not match the format stays text. Both also answer a *partial* question (how much of a prefix
is already decided), which is what lets :mod:`gymserve.parsers.streaming` stream without ever
emitting something the whole-text parse would not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from gymserve.parsers.call_scan import CallScanner, CallStart, CallSyntax, ReasoningText, ScanEvent
from gymserve.parsers.json_scan import declared_tool_names
from gymserve.registry import REASONING_PARSERS, TOOL_CALL_PARSERS, Registry
from gymserve.wire.ids import new_id


@dataclass
class ParsedToolCall:
    """One function call found in generated text.

    ``arguments`` is a string: the model's own text of the arguments object (not re-serialized, so
    what was streamed is what is returned), ``"{}"`` when the call had none. It is valid JSON
    unless the model wrote invalid JSON after committing to the call, or generation stopped inside
    it (see :mod:`gymserve.parsers.call_scan`); OpenAI documents the same of its own models'
    arguments, so callers validate before executing.
    """

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """Generated text split into its parts.

    ``reasoning``: text of the reasoning span (tags and adjacent whitespace stripped), or None when
    there is none or it is empty.
    ``content``: the visible answer with leading/trailing whitespace stripped, or None when there is
    none (e.g. only tool calls).
    ``tool_calls``: calls to execute, in order; never ones drafted inside reasoning.
    ``reasoning_incomplete``: generation stopped (``finish_reason == "length"``) inside the
    reasoning span.
    """

    reasoning: str | None
    content: str | None
    tool_calls: list[ParsedToolCall]
    reasoning_incomplete: bool = False


def collect_all(events: Iterable[ScanEvent]) -> tuple[str | None, str | None, list[ParsedToolCall]]:
    """``(reasoning, content, calls)`` of a scanner's events: reasoning and content pieces each
    joined and stripped (None when blank); each :class:`CallStart` with the :class:`CallArguments`
    after it is one call."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ParsedToolCall] = []
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif isinstance(event, ReasoningText):
            reasoning.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ParsedToolCall(event.name, ""))
        else:
            calls[-1].arguments += event.text
    return "".join(reasoning).strip() or None, "".join(content).strip() or None, calls


def collect_events(events: Iterable[ScanEvent]) -> tuple[str | None, list[ParsedToolCall]]:
    """``(content, calls)`` of a scanner's events (:func:`collect_all` without the reasoning)."""
    _, content, calls = collect_all(events)
    return content, calls


class ChannelScanner(Protocol):
    """The scanner of a format that structures the whole generation in channels (harmony):
    ``feed``/``finish`` return every kind of :data:`ScanEvent`, reasoning included; after
    ``finish``, ``open_kind == "reasoning"`` when the text ended inside reasoning."""

    open_kind: str | None

    def feed(self, delta: str) -> list[ScanEvent]: ...

    def finish(self) -> list[ScanEvent]: ...


def channel_scanner(
    tool_parser: ToolCallParser | None, reasoning_parser: ReasoningParser | None, tools: list[dict[str, Any]] | None
) -> ChannelScanner | None:
    """The whole-generation scanner when either parser is a channel format (``channels``), else
    None. Calls are parsed only when the tool parser is that format and tools are declared (a
    call to an undeclared tool cannot be executed: its arguments stay content)."""
    owner = next((p for p in (tool_parser, reasoning_parser) if p is not None and p.channels), None)
    if owner is None:
        return None
    parse_calls = tool_parser is not None and tool_parser.channels and bool(declared_tool_names(tools))
    return owner.channel_scanner(parse_calls)


class WholeTextScanner:
    """The scanner of a parser without a :class:`CallSyntax`: decides nothing until the text is
    complete, then asks the parser's ``parse_final`` (right for formats that are a property of the
    whole message; streaming then holds the message to the end)."""

    def __init__(self, parser: ToolCallParser, tools: list[dict[str, Any]] | None) -> None:
        self.parser, self.tools, self.text = parser, tools, ""

    def feed(self, delta: str) -> list[ScanEvent]:
        self.text += delta
        return []

    def finish(self) -> list[ScanEvent]:
        return self.parser.parse_final(self.text, self.tools)


class ToolCallParser:
    """Finds tool calls in the text that follows the reasoning span.

    ``tools`` below is the request's tool list, chat form (``[{"type": "function", "function":
    {"name", ...}}]``) or Responses form (``[{"type": "function", "name", ...}]``), or None.
    A subclass either sets ``syntax`` (a :class:`CallSyntax`: the shared incremental scanner then
    streams its calls, arguments included, as they are generated) or overrides
    :meth:`parse_final` (decided once the text is complete). Parsing never raises on model output;
    text that is not a call stays content.
    """

    name: ClassVar[str]
    syntax: ClassVar[CallSyntax | None] = None
    channels: ClassVar[bool] = False
    """True for a format that structures the whole generation (harmony): then
    :meth:`channel_scanner` parses reasoning, content and calls at once (``channel_scanner()``)."""

    def channel_scanner(self, parse_calls: bool) -> ChannelScanner:
        """The whole-generation scanner of a ``channels`` format."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        """An id for a call this parser found (``call_…``; a format may require its own form)."""
        return new_id("call")

    def history_call_id(self, call_id: str) -> str:
        """The id a call of the history (and the tool message answering it) is rendered with for
        this format: ``call_id`` unchanged unless the format restricts ids (Mistral)."""
        return call_id

    def history(self, messages: list[Any]) -> list[Any]:
        """Chat ``messages`` with every tool-call id and ``tool_call_id`` passed through
        :meth:`history_call_id` (a new list; messages are copied only when an id changes)."""
        out = []
        for msg in messages:
            if isinstance(msg, dict):
                msg = self._history_message(msg)
            out.append(msg)
        return out

    def _history_message(self, msg: dict[str, Any]) -> dict[str, Any]:
        if isinstance(msg.get("tool_call_id"), str):
            mapped = self.history_call_id(msg["tool_call_id"])
            if mapped != msg["tool_call_id"]:
                msg = {**msg, "tool_call_id": mapped}
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            new_calls = [
                {**c, "id": self.history_call_id(c["id"])}
                if isinstance(c, dict) and isinstance(c.get("id"), str)
                else c
                for c in calls
            ]
            if new_calls != calls:
                msg = {**msg, "tool_calls": new_calls}
        return msg

    def adjust_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat request for an upstream that speaks this format (the chat backend's raw-text
        path), as vLLM's ``ToolParser.adjust_request``: the history's ids in the format's form
        (:meth:`history`); a format may add what its raw text needs."""
        messages = body.get("messages")
        if isinstance(messages, list):
            body = {**body, "messages": self.history(messages)}
        return body

    def scanner(self, tools: list[dict[str, Any]] | None) -> CallScanner | WholeTextScanner:
        """A fresh scanner for one generation: ``feed(delta)`` and ``finish()`` return
        :data:`ScanEvent` lists whose concatenation does not depend on how the text was split."""
        if self.syntax is None:
            return WholeTextScanner(self, tools)
        return CallScanner(self.syntax, declared_tool_names(tools))

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> tuple[str | None, list[ParsedToolCall]]:
        """``(content, calls)`` of a complete text: content stripped (None when nothing but calls
        and whitespace), calls in order."""
        scanner = self.scanner(tools)
        return collect_events(scanner.feed(text) + scanner.finish())

    def parse_final(self, text: str, tools: list[dict[str, Any]] | None) -> list[ScanEvent]:
        """Events of a complete text (only needed when ``syntax`` is None)."""
        raise NotImplementedError


class ReasoningParser:
    """Splits generated text into reasoning and the rest.

    ``split(text, prompt_tail, finish_reason)`` returns ``(reasoning, rest, incomplete)``.
    ``prompt_tail`` is the end of the real rendered prompt text (a template that pre-fills
    ``<think>`` makes the model emit only ``</think>``); ``finish_reason`` decides the case of an
    unclosed span: ``"length"`` (or ``"abort"``, a call ended by a pause) → it is reasoning and
    ``incomplete`` is True; ``"stop"`` → the model
    skipped thinking, so the text is content. ``rest`` is always a suffix of ``text``.
    """

    name: ClassVar[str]
    channels: ClassVar[bool] = False
    """As :attr:`ToolCallParser.channels`."""

    def channel_scanner(self, parse_calls: bool) -> ChannelScanner:
        """The whole-generation scanner of a ``channels`` format."""
        raise NotImplementedError

    def split(self, text: str, prompt_tail: str, finish_reason: str) -> tuple[str | None, str, bool]:
        raise NotImplementedError

    close_tag: ClassVar[str] = ""
    """The literal that ends the span (held back while streaming when a suffix may start it)."""

    def open_body(self, text: str, prompt_tail: str, search_from: int = 0) -> int | None:
        """Index where reasoning text starts when ``text`` has an open span whose text is reasoning
        whatever follows, so it can stream before the span closes; None otherwise (the default:
        reasoning is held until :meth:`split_partial` decides). ``search_from`` as for
        :meth:`split_partial`."""
        return None

    def split_partial(self, text: str, prompt_tail: str, search_from: int = 0) -> tuple[str | None, str] | None:
        """``(reasoning, rest)`` once the span's end is decided by ``text`` alone, else None.

        When it returns a pair, ``split(text + anything, ...)`` gives the same reasoning and a rest
        that starts with this ``rest`` (up to leading whitespace). ``search_from``: the caller
        knows the close tag does not start before this index (streaming passes it so a long span
        is not searched again on every delta). The default never decides early, so streaming holds
        all text until the end.
        """
        return None


P = TypeVar("P", bound=type)


def _registry_of(cls: type) -> Registry[Any]:
    if issubclass(cls, ToolCallParser):
        return TOOL_CALL_PARSERS
    if issubclass(cls, ReasoningParser):
        return REASONING_PARSERS
    raise TypeError(f"{cls.__name__} is neither a ToolCallParser nor a ReasoningParser")


def register(name: str) -> Callable[[P], P]:
    """Class decorator: register a :class:`ToolCallParser` or :class:`ReasoningParser` under ``name``
    (in :data:`TOOL_CALL_PARSERS` / :data:`REASONING_PARSERS`) and set the class's ``name``.

    Raises ``ValueError`` when ``name`` is taken by another class, ``TypeError`` for a class that is
    neither kind of parser."""

    def decorate(cls: P) -> P:
        _registry_of(cls).register(name, cls)
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return decorate


def tool_call_parser_names() -> list[str]:
    """Registered tool-call parser names, sorted."""
    return sorted(TOOL_CALL_PARSERS.names())


def reasoning_parser_names() -> list[str]:
    """Registered reasoning parser names, sorted."""
    return sorted(REASONING_PARSERS.names())


def get_tool_call_parser(name: str) -> ToolCallParser:
    """A new instance of the tool-call parser registered as ``name``; ``registry.UnknownNameError``
    (a ``ValueError``) lists the choices."""
    return TOOL_CALL_PARSERS.get(name)()


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A new instance of the reasoning parser registered as ``name``; ``registry.UnknownNameError``
    (a ``ValueError``) lists the choices."""
    return REASONING_PARSERS.get(name)()
