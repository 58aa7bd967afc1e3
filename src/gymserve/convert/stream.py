"""Chat Completions chunks → Responses streaming events (pure, no I/O).

The final response of a stream is ``chat_to_response`` of the accumulated completion, so streamed
and non-streamed answers cannot drift apart; the events only announce it piece by piece.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from gymserve.convert.chat_to_responses import (
    chat_to_response,
    function_call_item,
    message_item,
    message_items,
    message_segments,
    normalize_arguments,
    output_text_part,
    reasoning_item,
    response_envelope,
)
from gymserve.convert.chunks import ChunkAccumulator
from gymserve.protocol import ResponsesRequest
from gymserve.wire.ids import new_id
from gymserve.wire.reasoning import REASONING_FIELDS

Event = dict[str, Any]


@dataclass
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    output_index: int
    emitted: str = ""
    parts: int = 0  # content parts announced (content_part.added)
    final: dict[str, Any] | None = None  # what its output_item.done said (None: still open)
    key: Any = None  # tool-call index for function_call items
    call_id: str = ""
    name: str = ""

    @property
    def closed(self) -> bool:
        return self.final is not None


@dataclass
class _Phase:
    """A stretch of the generation: text (reasoning, content, refusal), then tool calls. The next
    text after a call, or reasoning after answer text, starts a new phase, so items are announced
    in the order the model wrote them."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    keys: list[Any] = field(default_factory=list)  # its tool calls' keys in the accumulator
    segments: list[_Item] = field(default_factory=list)  # its reasoning/message items
    after_call: bool = False  # it follows a tool call: whitespace it starts with separates, it is not text
    plain: bool = True  # only content without "<" so far: its one message item grows without re-splitting
    held: str = ""  # trailing whitespace of plain content, sent once text follows it
    frozen: list[dict[str, Any]] | None = None  # its calls as closed (arguments sent later are not its)

    def view(self) -> dict[str, Any]:
        content = "".join(self.content)
        return {
            "content": content.lstrip() if self.after_call else content,
            REASONING_FIELDS[0]: "".join(self.reasoning),
        }

    def message(self, accumulator: ChunkAccumulator) -> dict[str, Any]:
        calls = self.frozen if self.frozen is not None else [accumulator.tool_calls[k] for k in self.keys]
        return {**self.view(), "refusal": "".join(self.refusal), "tool_calls": calls}


class ResponseStreamBuilder:
    """Turns chat-completion chunks into Responses streaming events.

    Use: ``start()`` (response.created, response.in_progress), ``feed(chunk)`` per chunk, then
    ``finish()`` (closes open items, ends with response.completed or response.incomplete), or
    ``fail(message)`` (response.failed). Each item gets the full lifecycle the OpenAI SDK's stream
    state machine needs (case ST-01): output_item.added → content_part.added → deltas → *.done →
    content_part.done → output_item.done; function calls get function_call_arguments.delta/.done.
    ``sequence_number`` counts 0, 1, 2…; ``output_index`` is the item's index in the final output.

    Items are announced in generation order and each is done before the next is added, except
    the function calls of one batch, which stay open until it ends (servers may interleave their
    arguments). The
    final response is ``chat_to_response`` of the accumulated completion with the streamed ids;
    when the model wrote text after a tool call (or reasoning after answer text) its output keeps
    that order too (``turns``), so it always matches the streamed items, and a non-streamed
    answer built from the same chunks is the same Response.

    ``reasoning_events``: ``"reasoning_text"`` emits ``response.reasoning_text.delta/.done`` (OpenAI
    API, openai SDK, vLLM); ``"reasoning"`` emits the Open Responses spec's
    ``response.reasoning.delta/.done`` (same fields).
    """

    def __init__(
        self,
        request: ResponsesRequest,
        *,
        response_id: str | None = None,
        created_at: float | None = None,
        model: str | None = None,
        reasoning_events: Literal["reasoning_text", "reasoning"] = "reasoning_text",
    ):
        self.request = request
        self.response_id = response_id or new_id("resp")
        self.created_at = int(created_at if created_at is not None else time.time())
        self.model = model
        self.accumulator = ChunkAccumulator()
        self._reasoning_prefix = f"response.{reasoning_events}"
        self._seq = 0
        self._items: list[_Item] = []
        self._phases: list[_Phase] = [_Phase()]
        self._pending: _Phase | None = None  # a phase the model moved on from, still to be closed
        self._tools: dict[Any, _Item] = {}
        self.response: dict[str, Any] | None = None

    # -- public ------------------------------------------------------------------------------

    def start(self) -> list[Event]:
        """response.created and response.in_progress, with an empty in-progress response."""
        shell = self._envelope("in_progress")
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=self._envelope("in_progress")),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """Events for one ``ChatCompletionChunk`` dict (possibly none)."""
        added = self.accumulator.add(chunk)
        events: list[Event] = []
        phase = self._phases[-1]
        if added["reasoning"] or added["content"] or added["refusal"]:
            # The model moved on: text after this phase's calls, or reasoning after its answer text.
            if phase.keys or (added["reasoning"] and phase.content and phase.segments):
                # A new phase; the old one is closed when the new one announces an item, so if none
                # ever does (only whitespace follows), finish() closes it with the final values.
                if not phase.keys:
                    events += self._sync_segments(phase, final=True)
                self._pending = phase
                phase = _Phase(after_call=bool(phase.keys))
                self._phases.append(phase)
            for kind in ("reasoning", "content", "refusal"):
                if added[kind]:
                    getattr(phase, kind).append(added[kind])
            phase.plain = phase.plain and not phase.reasoning and "<" not in added["content"]
            events += (
                self._plain_text(phase, added["content"]) if phase.plain else self._sync_segments(phase, final=False)
            )
        for key, is_new, args in added["tool_calls"]:
            if is_new:
                if not phase.keys:
                    # Text ends where tool calls begin: settle what the final split keeps.
                    events += self._sync_segments(phase, final=True)
                    events += self._close_text(phase)
                events += self._open_function_call(key)
                phase.keys.append(key)
            if args and not self._tools[key].closed:
                events += self._arguments_delta(self._tools[key], args)
        return events

    def finish(self) -> list[Event]:
        """Close every open item with the final values, then response.completed/.incomplete.

        The final response is ``chat_to_response(self.accumulator.completion(), request, …)`` with
        the streamed item ids, so it equals the non-streamed answer for the same chunks.
        """
        last = self._phases[-1]
        events = self._sync_segments(last, final=True) if not last.keys else []
        if self.model and not self.accumulator.model:
            self.accumulator.model = self.model
        turns = [p.message(self.accumulator) for p in self._phases] if len(self._phases) > 1 else None
        response = chat_to_response(
            self.accumulator.completion(),
            self.request,
            response_id=self.response_id,
            created_at=self.created_at,
            item_ids=[it.id for it in self._items],
            turns=turns,
        )
        output = response["output"]
        for item in self._items:
            if not item.closed and item.output_index < len(output):
                events += self._close(item, output[item.output_index])
        for index in range(len(self._items), len(output)):
            events += self._replay(index, output[index])
        self.response = response
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return events

    def fail(self, message: str) -> list[Event]:
        """response.failed with ``error: {"code": "server_error", "message": message}``; its output
        holds the items streamed so far as they were sent — done ones as done, open ones with what
        they had (status ``incomplete``) — so a client keeps what it was shown."""
        output = []
        for item in self._items:
            if item.final is not None:  # done already: as it was sent
                output.append(item.final)
            elif item.kind == "function_call":
                output.append(function_call_item(item.id, item.call_id, item.name, item.emitted, "incomplete"))
            elif item.kind == "reasoning":
                output.append(reasoning_item(item.id, item.emitted))
            else:
                output.append(message_item(item.id, item.emitted, "incomplete"))
        response = self._envelope("failed", error={"code": "server_error", "message": message}, output=output)
        self.response = response
        return [self._event("response.failed", response=response)]

    # -- helpers -----------------------------------------------------------------------------

    def _envelope(self, status: str, **kwargs: Any) -> dict[str, Any]:
        return response_envelope(
            self.request,
            model=self.model or self.accumulator.model,
            status=status,
            response_id=self.response_id,
            created_at=self.created_at,
            **kwargs,
        )

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _new_item(self, kind: str, prefix: str) -> _Item:
        item = _Item(kind=kind, id=new_id(prefix), output_index=len(self._items))
        self._items.append(item)
        return item

    def _sync_segments(self, phase: _Phase, *, final: bool) -> list[Event]:
        events: list[Event] = []
        segments = message_segments(phase.view(), final=final)
        for i, (kind, text) in enumerate(segments):
            if i == len(phase.segments):
                events += self._flush() + self._close_items(phase.segments)
                item = self._new_item(
                    "reasoning" if kind == "reasoning" else "message", "rs" if kind == "reasoning" else "msg"
                )
                phase.segments.append(item)
                events += self._open_part(item)
            item = phase.segments[i]
            if item.closed or not text.startswith(item.emitted):
                continue  # cannot un-say streamed text; finish() still sends the exact final item
            events += self._text_delta(item, text[len(item.emitted) :])
        return events

    def _plain_text(self, phase: _Phase, piece: str) -> list[Event]:
        """What ``_sync_segments`` would send for content without tags — one message item, its
        trailing whitespace withheld — in time proportional to ``piece``, not to the whole text."""
        combined = phase.held + piece
        if not phase.segments and phase.after_call:
            combined = combined.lstrip()
        body = combined.rstrip()
        phase.held = combined[len(body) :]
        if not body:
            return []
        events: list[Event] = []
        if not phase.segments:
            events += self._flush()
            phase.segments.append(self._new_item("message", "msg"))
            events += self._open_part(phase.segments[0])
        return events + self._text_delta(phase.segments[0], body)

    def _flush(self) -> list[Event]:
        """Close the phase the model moved on from, before the next item is announced."""
        phase, self._pending = self._pending, None
        return self._close_phase(phase) if phase is not None else []

    def _close_phase(self, phase: _Phase) -> list[Event]:
        """Everything of a phase the model has moved on from, with the values streamed."""
        events = self._sync_segments(phase, final=True) if not phase.keys else []
        events += self._close_text(phase)
        turn = phase.message(self.accumulator)
        phase.frozen = copy.deepcopy(turn["tool_calls"])
        for key, call in zip(phase.keys, turn["tool_calls"]):
            item = self._tools[key]
            if not item.closed:
                events += self._close(
                    item,
                    function_call_item(
                        item.id,
                        item.call_id,
                        call["function"]["name"],
                        normalize_arguments(call["function"]["arguments"]),
                        "completed",
                    ),
                )
        return events

    def _close_items(self, items: list[_Item]) -> list[Event]:
        """Close items whose text is settled (a later segment began) with what was streamed."""
        events: list[Event] = []
        for item in items:
            if not item.closed:
                final = (
                    reasoning_item(item.id, item.emitted)
                    if item.kind == "reasoning"
                    else message_item(item.id, item.emitted, "completed")
                )
                events += self._close(item, final)
        return events

    def _close_text(self, phase: _Phase) -> list[Event]:
        """Close a phase's reasoning/message items with their final values (a refusal part
        included; a message holding only a refusal is announced and closed here)."""
        ids = iter([item.id for item in phase.segments])
        finals = message_items(
            {**phase.view(), "refusal": "".join(phase.refusal)}, lambda prefix: next(ids, None) or new_id(prefix)
        )
        events: list[Event] = []
        for index, final in enumerate(finals):
            if index < len(phase.segments):
                if not phase.segments[index].closed:
                    events += self._close(phase.segments[index], final)
            else:
                events += self._flush() + self._replay(len(self._items), final)
                phase.segments.append(self._items[-1])
        return events

    def _open_part(self, item: _Item, *, with_part: bool = True) -> list[Event]:
        """output_item.added with the empty shell, then (``with_part``) content_part.added for the
        text part at content_index 0."""
        if item.kind == "reasoning":
            shell, part = reasoning_item(item.id, None), {"type": "reasoning_text", "text": ""}
        else:
            shell, part = message_item(item.id, None, "in_progress"), output_text_part("")
        events = [self._event("response.output_item.added", output_index=item.output_index, item=shell)]
        if with_part:
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=item.output_index,
                    content_index=0,
                    part=part,
                )
            )
            item.parts = 1
        return events

    def _text_delta(self, item: _Item, delta: str) -> list[Event]:
        if not delta:
            return []
        item.emitted += delta
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0, "delta": delta}
        if item.kind == "reasoning":
            return [self._event(f"{self._reasoning_prefix}.delta", **where)]
        return [self._event("response.output_text.delta", **where, logprobs=[])]

    def _open_function_call(self, key: Any) -> list[Event]:
        events = self._flush()
        entry = self.accumulator.tool_calls[key]
        item = self._new_item("function_call", "fc")
        item.key, item.call_id, item.name = key, entry["id"], entry["function"]["name"]
        self._tools[key] = item
        shell = function_call_item(item.id, item.call_id, item.name, "", "in_progress")
        return events + [self._event("response.output_item.added", output_index=item.output_index, item=shell)]

    def _arguments_delta(self, item: _Item, delta: str) -> list[Event]:
        if not delta:
            return []
        item.emitted += delta
        return [
            self._event(
                "response.function_call_arguments.delta", item_id=item.id, output_index=item.output_index, delta=delta
            )
        ]

    def _close(self, item: _Item, final: dict[str, Any]) -> list[Event]:
        """Remaining delta (what was withheld), the done events, output_item.done with ``final``."""
        item.final = final
        where = {"item_id": item.id, "output_index": item.output_index}
        if final.get("type") == "function_call":
            args = final["arguments"]
            events = self._arguments_delta(item, args[len(item.emitted) :]) if args.startswith(item.emitted) else []
            events.append(
                self._event("response.function_call_arguments.done", **where, name=final["name"], arguments=args)
            )
        else:
            events = []
            parts = final.get("content") or []
            if not parts and item.parts:  # announced but empty: close the announced text part
                parts = [{"type": "reasoning_text", "text": ""} if item.kind == "reasoning" else output_text_part("")]
            for index, part in enumerate(parts):
                events += self._close_part(item, index, part)
        events.append(self._event("response.output_item.done", output_index=item.output_index, item=final))
        return events

    def _close_part(self, item: _Item, index: int, part: dict[str, Any]) -> list[Event]:
        """A content part's last delta and done events (announcing it first if it never was): text
        and reasoning stream through ``_text_delta``; a refusal is sent whole."""
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": index}
        events: list[Event] = []
        if index >= item.parts:
            shell = {**part, "refusal": ""} if part.get("type") == "refusal" else {**part, "text": ""}
            events.append(self._event("response.content_part.added", **where, part=shell))
            item.parts = index + 1
        if part.get("type") == "refusal":
            events.append(self._event("response.refusal.delta", **where, delta=part["refusal"]))
            events.append(self._event("response.refusal.done", **where, refusal=part["refusal"]))
        else:
            text = part.get("text", "")
            if index == 0 and text.startswith(item.emitted):
                events += self._text_delta(item, text[len(item.emitted) :])
            elif index > 0 and text:
                events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
            if item.kind == "reasoning":
                events.append(self._event(f"{self._reasoning_prefix}.done", **where, text=text))
            else:
                events.append(self._event("response.output_text.done", **where, text=text, logprobs=[]))
        events.append(self._event("response.content_part.done", **where, part=part))
        return events

    def _replay(self, index: int, final: dict[str, Any]) -> list[Event]:
        """Full lifecycle for an item the chunks never announced (e.g. text that was all withheld)."""
        kind: str = final["type"]  # every output item chat_to_response builds has a type
        item = _Item(kind=kind, id=final["id"], output_index=index)
        self._items.append(item)
        if kind == "function_call":
            shell = function_call_item(item.id, final["call_id"], final["name"], "", "in_progress")
            events = [self._event("response.output_item.added", output_index=index, item=shell)]
        else:
            events = self._open_part(item, with_part=False)
        return events + self._close(item, final)
