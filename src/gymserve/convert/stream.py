"""Chat Completions chunks → Responses streaming events (pure, no I/O).

The final response of a stream is ``chat_to_response`` of the accumulated completion, so streamed
and non-streamed answers cannot drift apart; the events only announce it piece by piece.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from gymserve.convert.chat_to_responses import (
    chat_to_response,
    function_call_item,
    message_item,
    message_segments,
    new_id,
    output_text_part,
    reasoning_item,
    response_envelope,
)
from gymserve.protocol import TRAINING_FIELDS, ChatCompletionDict, ResponsesRequest

Event = dict[str, Any]


class ChunkAccumulator:
    """Folds ``ChatCompletionChunk`` dicts (choice 0) into one ``ChatCompletion`` dict.

    Accepts full chunks (``{"id", "model", "choices": [{"delta", "finish_reason"}], "usage"}``) and
    bare choices (``{"delta", "finish_reason"}``). Reasoning comes from ``delta.reasoning_content``
    or ``delta.reasoning`` (one per delta, never both, as in ``field_reasoning``). Training fields may
    ride on the delta, the choice or the chunk: ``prompt_token_ids`` is replaced, the generation
    lists are extended, so both "all on the last chunk" and "per-chunk pieces" servers work.
    """

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[Any, dict[str, Any]] = {}  # insertion order = order of first appearance
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.tokens: dict[str, list] = {}

    def add(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """Fold one chunk; returns what it added: ``{"reasoning", "content", "tool_calls": [(key,
        is_new, arguments_delta)]}``."""
        added: dict[str, Any] = {"reasoning": "", "content": "", "tool_calls": []}
        if not isinstance(chunk, dict):
            return added
        if "choices" not in chunk and "delta" in chunk:
            chunk = {"choices": [chunk]}
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        self._take_tokens(chunk)
        choices = chunk.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        self._take_tokens(choice)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        self._take_tokens(delta)
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self.reasoning.append(reasoning)
            added["reasoning"] = reasoning
        if isinstance(delta.get("content"), str) and delta["content"]:
            self.content.append(delta["content"])
            added["content"] = delta["content"]
        if isinstance(delta.get("refusal"), str):
            self.refusal.append(delta["refusal"])
        for pos, tc in enumerate(delta.get("tool_calls") or []):
            if isinstance(tc, dict):
                added["tool_calls"].append(self._take_tool_call(pos, tc))
        return added

    def _take_tool_call(self, pos: int, tc: dict[str, Any]) -> tuple[Any, bool, str]:
        key = tc.get("index", pos)
        function = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        is_new = key not in self.tool_calls
        if is_new:
            self.tool_calls[key] = {"id": tc.get("id") or new_id("call"), "type": "function",
                                    "function": {"name": "", "arguments": ""}}
        entry = self.tool_calls[key]["function"]
        if function.get("name") and not entry["name"]:
            entry["name"] = function["name"]
        args = function.get("arguments")
        if isinstance(args, (dict, list)):  # non-standard servers send the object whole
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            args = ""
        entry["arguments"] += args
        return key, is_new, args

    def _take_tokens(self, obj: dict[str, Any]) -> None:
        for field in TRAINING_FIELDS:
            value = obj.get(field)
            if value is None:
                continue
            if field == "prompt_token_ids" or not isinstance(value, list):
                self.tokens[field] = value
            else:
                self.tokens[field] = [*self.tokens.get(field, []), *value]

    def message_view(self) -> dict[str, Any]:
        """The assistant message so far (reasoning and content only)."""
        return {"content": "".join(self.content), "reasoning_content": "".join(self.reasoning)}

    def completion(self) -> ChatCompletionDict:
        """The accumulated ``ChatCompletion`` dict (``finish_reason`` "stop" if none was sent)."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if "".join(self.refusal):
            message["refusal"] = "".join(self.refusal)
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls.values())
        message.update(self.tokens)
        return {
            "id": self.id or new_id("chatcmpl"),
            "object": "chat.completion",
            "created": int(self.created or time.time()),
            "model": self.model or "",
            "choices": [{"index": 0, "finish_reason": self.finish_reason or "stop", "logprobs": None,
                         "message": message}],
            "usage": self.usage,
        }


@dataclass
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    output_index: int
    emitted: str = ""
    closed: bool = False
    key: Any = None  # tool-call index for function_call items
    call_id: str = ""
    name: str = ""


class ResponseStreamBuilder:
    """Turns chat-completion chunks into Responses streaming events.

    Use: ``start()`` (response.created, response.in_progress), ``feed(chunk)`` per chunk, then
    ``finish()`` (closes open items, ends with response.completed or response.incomplete), or
    ``fail(message)`` (response.failed). Each item gets the full lifecycle the OpenAI SDK's stream
    state machine needs (case ST-01): output_item.added → content_part.added → deltas → *.done →
    content_part.done → output_item.done; function calls get function_call_arguments.delta/.done.
    ``sequence_number`` counts 0, 1, 2…; ``output_index`` is the item's index in the final output.

    ``reasoning_events``: ``"reasoning_text"`` emits ``response.reasoning_text.delta/.done`` (OpenAI
    API, openai SDK, vLLM); ``"reasoning"`` emits the Open Responses spec's
    ``response.reasoning.delta/.done`` (same fields). Limitation: content or reasoning arriving after
    the first tool-call delta is kept in the final response but not streamed as deltas.
    """

    def __init__(self, request: ResponsesRequest, *, response_id: str | None = None,
                 created_at: float | None = None, model: str | None = None,
                 reasoning_events: Literal["reasoning_text", "reasoning"] = "reasoning_text"):
        self.request = request
        self.response_id = response_id or new_id("resp")
        self.created_at = int(created_at if created_at is not None else time.time())
        self.model = model
        self.accumulator = ChunkAccumulator()
        self._reasoning_prefix = f"response.{reasoning_events}"
        self._seq = 0
        self._items: list[_Item] = []
        self._segment_items: list[_Item] = []
        self._tools: dict[Any, _Item] = {}
        self.response: dict[str, Any] | None = None

    # -- public ------------------------------------------------------------------------------

    def start(self) -> list[Event]:
        """response.created and response.in_progress, with an empty in-progress response."""
        shell = self._envelope("in_progress")
        return [self._event("response.created", response=shell),
                self._event("response.in_progress", response=self._envelope("in_progress"))]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """Events for one ``ChatCompletionChunk`` dict (possibly none)."""
        added = self.accumulator.add(chunk)
        events: list[Event] = []
        if (added["reasoning"] or added["content"]) and not self._tools:
            events += self._sync_segments(final=False)
        for key, is_new, args in added["tool_calls"]:
            if is_new:
                if not self._tools:
                    # Text ends where tool calls begin: settle what the final split keeps.
                    events += self._sync_segments(final=True)
                    events += self._close_segments()
                events += self._open_function_call(key)
            if args:
                events += self._arguments_delta(self._tools[key], args)
        return events

    def finish(self) -> list[Event]:
        """Close every open item with the final values, then response.completed/.incomplete.

        The final response is ``chat_to_response(self.accumulator.completion(), request, …)`` with
        the streamed item ids, so it equals the non-streamed answer for the same chunks.
        """
        events = self._sync_segments(final=True) if not self._tools else []
        if self.model and not self.accumulator.model:
            self.accumulator.model = self.model
        response = chat_to_response(self.accumulator.completion(), self.request, response_id=self.response_id,
                                    created_at=self.created_at, item_ids=[it.id for it in self._items])
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
        """response.failed with ``error: {"code": "server_error", "message": message}``."""
        response = self._envelope("failed", error={"code": "server_error", "message": message})
        self.response = response
        return [self._event("response.failed", response=response)]

    # -- helpers -----------------------------------------------------------------------------

    def _envelope(self, status: str, **kwargs: Any) -> dict[str, Any]:
        return response_envelope(self.request, model=self.model or self.accumulator.model, status=status,
                                 response_id=self.response_id, created_at=self.created_at, **kwargs)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _new_item(self, kind: str, prefix: str) -> _Item:
        item = _Item(kind=kind, id=new_id(prefix), output_index=len(self._items))
        self._items.append(item)
        return item

    def _sync_segments(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        segments = message_segments(self.accumulator.message_view(), final=final)
        for i, (kind, text) in enumerate(segments):
            if i == len(self._segment_items):
                events += self._close_segments()
                item = self._new_item("reasoning" if kind == "reasoning" else "message",
                                      "rs" if kind == "reasoning" else "msg")
                self._segment_items.append(item)
                events += self._open_part(item)
            item = self._segment_items[i]
            if item.closed or not text.startswith(item.emitted):
                continue  # cannot un-say streamed text; finish() still sends the exact final item
            events += self._text_delta(item, text[len(item.emitted):])
        return events

    def _close_segments(self) -> list[Event]:
        events: list[Event] = []
        for item in self._segment_items:
            if not item.closed:
                final = (reasoning_item(item.id, item.emitted) if item.kind == "reasoning"
                         else message_item(item.id, item.emitted, "completed"))
                events += self._close(item, final)
        return events

    def _open_part(self, item: _Item) -> list[Event]:
        if item.kind == "reasoning":
            shell, part = reasoning_item(item.id, None), {"type": "reasoning_text", "text": ""}
        else:
            shell, part = message_item(item.id, None, "in_progress"), output_text_part("")
        return [self._event("response.output_item.added", output_index=item.output_index, item=shell),
                self._event("response.content_part.added", item_id=item.id, output_index=item.output_index,
                            content_index=0, part=part)]

    def _text_delta(self, item: _Item, delta: str) -> list[Event]:
        if not delta:
            return []
        item.emitted += delta
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0, "delta": delta}
        if item.kind == "reasoning":
            return [self._event(f"{self._reasoning_prefix}.delta", **where)]
        return [self._event("response.output_text.delta", **where, logprobs=[])]

    def _open_function_call(self, key: Any) -> list[Event]:
        entry = self.accumulator.tool_calls[key]
        item = self._new_item("function_call", "fc")
        item.key, item.call_id, item.name = key, entry["id"], entry["function"]["name"]
        self._tools[key] = item
        shell = function_call_item(item.id, item.call_id, item.name, "", "in_progress")
        return [self._event("response.output_item.added", output_index=item.output_index, item=shell)]

    def _arguments_delta(self, item: _Item, delta: str) -> list[Event]:
        if not delta:
            return []
        item.emitted += delta
        return [self._event("response.function_call_arguments.delta", item_id=item.id,
                            output_index=item.output_index, delta=delta)]

    def _close(self, item: _Item, final: dict[str, Any]) -> list[Event]:
        """Remaining delta (what was withheld), the done events, output_item.done with ``final``."""
        item.closed = True
        where = {"item_id": item.id, "output_index": item.output_index}
        if final.get("type") == "function_call":
            args = final["arguments"]
            events = self._arguments_delta(item, args[len(item.emitted):]) if args.startswith(item.emitted) else []
            events.append(self._event("response.function_call_arguments.done", **where, name=final["name"],
                                      arguments=args))
        else:
            parts = final.get("content") or []
            part = parts[0] if parts else ({"type": "reasoning_text", "text": ""} if item.kind == "reasoning"
                                           else output_text_part(""))
            text = part.get("text", "")
            events = self._text_delta(item, text[len(item.emitted):]) if text.startswith(item.emitted) else []
            if item.kind == "reasoning":
                events.append(self._event(f"{self._reasoning_prefix}.done", **where, content_index=0, text=text))
            else:
                events.append(self._event("response.output_text.done", **where, content_index=0, text=text,
                                          logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        events.append(self._event("response.output_item.done", output_index=item.output_index, item=final))
        return events

    def _replay(self, index: int, final: dict[str, Any]) -> list[Event]:
        """Full lifecycle for an item the chunks never announced (e.g. text that was all withheld)."""
        kind = final.get("type")
        item = _Item(kind=kind, id=final["id"], output_index=index)
        self._items.append(item)
        if kind == "function_call":
            shell = function_call_item(item.id, final["call_id"], final["name"], "", "in_progress")
            events = [self._event("response.output_item.added", output_index=index, item=shell)]
        else:
            events = self._open_part(item)
        return events + self._close(item, final)
