"""Chat Completions chunks → Anthropic Messages streaming events (pure, no I/O).

The events, as Anthropic's "Streaming Messages" page defines them: ``message_start`` (the Message
with empty ``content``), a ``ping``, then per content block ``content_block_start`` →
``content_block_delta``\\* → ``content_block_stop`` (deltas: ``text_delta``, ``thinking_delta`` then
one ``signature_delta``, ``input_json_delta``), then ``message_delta`` (``stop_reason``,
``stop_sequence``, cumulative ``usage``) and ``message_stop``.

The chunks go through ``ResponseStreamBuilder`` (the one place that decides item order, the
``<think>`` split and what text is safe to send yet) and its events are re-told as Messages events,
so a streamed Message is block for block the non-streamed one (``chat_to_messages``). Blocks are
strictly sequential: a text or thinking block starts with its first delta and stops when its item is
done; a ``tool_use`` block is sent whole when its call is complete (start, one ``input_json_delta``
with the whole input, stop), so the ``partial_json`` a client concatenates is always the valid
JSON of ``input``, whatever the model wrote. The training fields ride on the ``message_delta``
event, beside ``delta`` and ``usage`` (the anthropic SDK keeps them in the event's
``model_extra``; its ``get_final_message()`` does not copy them to the Message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gymserve.convert.chat_to_messages import (
    item_block,
    matched_stop_sequence,
    message_usage,
    response_to_message,
    thinking_signature,
)
from gymserve.convert.stream import ResponseStreamBuilder
from gymserve.protocol import MessageDict
from gymserve.wire.anthropic_errors import error_body
from gymserve.wire.ids import new_id

Event = dict[str, Any]


@dataclass
class _Block:
    kind: str  # "thinking" | "text" (tool_use blocks are sent whole)
    index: int | None = None  # the content block index, once started
    text: str = ""


class MessageStreamBuilder:
    """Turns chat-completion chunks into Messages streaming events.

    Use: ``start()`` (``message_start``, ``ping``), ``feed(chunk)`` per chunk, then ``finish()``
    (the open block closed, ``message_delta``, ``message_stop``) or ``fail(status, message)`` (an
    ``error`` event). ``message`` is the final ``Message`` once ``finish()`` ran. ``model``: the
    model named in ``message_start`` (the chunks' own wins in the final Message);
    ``stop_sequences``: the request's, to report which one a vLLM-style upstream stopped on.
    """

    def __init__(self, model: str, *, stop_sequences: list[str] | None = None, message_id: str | None = None):
        self.model = model
        self.message_id = message_id or new_id("msg")
        self.stop_sequences = stop_sequences or []
        self.stop_sequence: str | None = None
        self.message: MessageDict | None = None
        self._responses = ResponseStreamBuilder({"model": model}, model=model or None)
        self._items: dict[int, _Block] = {}  # Responses output_index -> block
        self._started = 0  # content blocks started so far (the next index)

    # -- public ------------------------------------------------------------------------------

    def start(self) -> list[Event]:
        """``message_start`` with an empty Message (usage counted at the end), then a ``ping``."""
        shell: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": message_usage(None),
        }
        return [{"type": "message_start", "message": shell}, {"type": "ping"}]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """Events for one ``ChatCompletionChunk`` dict (possibly none)."""
        for choice in chunk.get("choices") or () if isinstance(chunk, dict) else ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self.stop_sequence = matched_stop_sequence(choice, self.stop_sequences) or self.stop_sequence
        return self._retell(self._responses.feed(chunk))

    def finish(self) -> list[Event]:
        """The remaining blocks, ``message_delta`` (stop reason, usage, training fields) and
        ``message_stop``; sets :attr:`message`."""
        events = self._retell(self._responses.finish())
        response = self._responses.response
        assert response is not None  # ResponseStreamBuilder.finish always sets it
        message = response_to_message(response, stop_sequence=self.stop_sequence, message_id=self.message_id)
        self.message = message
        extra = {k: v for k, v in message.items() if k not in _MESSAGE_KEYS}
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        usage = message["usage"]
        events.append({"type": "message_delta", "delta": delta, "usage": usage, **extra})
        events.append({"type": "message_stop"})
        return events

    def fail(self, status: int, message: str) -> list[Event]:
        """The ``error`` event that ends a stream failing after its 200 (Anthropic's error object)."""
        return [error_body(status, message)]

    # -- Responses events → Messages events ---------------------------------------------------

    def _retell(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            kind = event["type"]
            if kind == "response.output_item.added":
                item_kind = event["item"]["type"]
                if item_kind in ("reasoning", "message"):
                    self._items[event["output_index"]] = _Block("thinking" if item_kind == "reasoning" else "text")
            elif kind in ("response.reasoning_text.delta", "response.output_text.delta", "response.refusal.delta"):
                out += self._delta(event["output_index"], event["delta"])
            elif kind == "response.output_item.done":
                out += self._done(event["output_index"], event["item"])
        return out

    def _delta(self, output_index: int, text: str) -> list[Event]:
        block = self._items.get(output_index)
        if block is None or not text:
            return []
        out = self._start(block)
        block.text += text
        key, delta_type = ("thinking", "thinking_delta") if block.kind == "thinking" else ("text", "text_delta")
        out.append({"type": "content_block_delta", "index": block.index, "delta": {"type": delta_type, key: text}})
        return out

    def _start(self, block: _Block) -> list[Event]:
        if block.index is not None:
            return []
        block.index = self._started
        self._started += 1
        empty = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if block.kind == "thinking"
            else {"type": "text", "text": ""}
        )
        return [{"type": "content_block_start", "index": block.index, "content_block": empty}]

    def _done(self, output_index: int, item: dict[str, Any]) -> list[Event]:
        final = item_block(item)
        if item.get("type") == "function_call":
            assert final is not None  # every function_call item has a tool_use block
            index = self._started
            self._started += 1
            start = {**final, "input": {}}
            return [
                {"type": "content_block_start", "index": index, "content_block": start},
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(final["input"], ensure_ascii=False),
                    },
                },
                {"type": "content_block_stop", "index": index},
            ]
        block = self._items.pop(output_index, None)
        if block is None or (block.index is None and final is None):
            return []  # an item with nothing to show (an empty message carrying token fields)
        out = self._start(block)
        if block.kind == "thinking":
            signature = final["signature"] if final is not None else thinking_signature(block.text)
            out.append(
                {
                    "type": "content_block_delta",
                    "index": block.index,
                    "delta": {"type": "signature_delta", "signature": signature},
                }
            )
        out.append({"type": "content_block_stop", "index": block.index})
        return out


_MESSAGE_KEYS = frozenset({"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"})


def context_exceeded_events(model: str) -> list[Event]:
    """The events of ``chat_to_messages.context_exceeded_message``: start, ping, a
    ``message_delta`` with ``stop_reason: model_context_window_exceeded``, stop (case CL-01)."""
    builder = MessageStreamBuilder(model)
    return [
        *builder.start(),
        {
            "type": "message_delta",
            "delta": {"stop_reason": "model_context_window_exceeded", "stop_sequence": None},
            "usage": message_usage(None),
        },
        {"type": "message_stop"},
    ]
