"""Chat answers → Anthropic ``Message`` objects (pure, no I/O).

A chat answer reaches the Messages API through the Responses output it builds (``chat_to_response``
for a completion, ``ResponseStreamBuilder`` for chunks): that is where the order of reasoning, text
and tool calls, the ``<think>`` split, refusals and the training fields are decided, once for both
APIs, and their outputs map item for block (``anthropic.types.ContentBlock``):

    reasoning item      → ``{"type": "thinking", "thinking", "signature"}`` (see :func:`thinking_signature`)
    message item        → ``{"type": "text", "text"}`` (its output_text and refusal parts, in order)
    function_call item  → ``{"type": "tool_use", "id": call_id, "name", "input"}`` (:func:`tool_input`)

Empty text and thinking blocks are left out. Stop reasons (:func:`stop_reason`, Anthropic's
``StopReason``): ``end_turn``; ``tool_use`` when the answer calls tools; ``max_tokens`` for a
generation cut at ``max_tokens`` (or at the context window); ``stop_sequence`` with
``stop_sequence`` set when the upstream says which of the request's ``stop_sequences`` matched
(vLLM's ``choices[].stop_reason``); ``refusal`` for a content filter or a refusal; ``pause_turn``
for a call ended by ``POST /pause?mode=abort`` (send it again); ``model_context_window_exceeded``
for a prompt that leaves no room to generate (:func:`context_exceeded_message`).

The training fields (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``) and
``weight_version`` (``weight_version_spans``) go on the ``Message`` itself, beside ``content``: the
Message is the assistant message a harness sends back (``{**message.to_param(), **message.model_extra}``
with the anthropic SDK).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from gymserve.protocol import TRAINING_FIELDS, VERSION_FIELDS, MessageDict, ResponseDict
from gymserve.wire.ids import new_id


def thinking_signature(thinking: str) -> str:
    """The ``signature`` of a thinking block: ``"gymserve:"`` + the first 32 hex digits of the
    thinking text's SHA-256. Anthropic's signature proves the block came from Claude; gymserve's
    proves nothing (anyone can compute it) and is not checked when the block comes back — it is
    there because the SDK types and clients that pass thinking blocks back expect one."""
    return "gymserve:" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def tool_input(arguments: Any) -> dict[str, Any]:
    """A function call's ``arguments`` (a JSON string) as the ``input`` object of a ``tool_use``
    block; ``{}`` when they are not a JSON object (a malformed call: the model's own text is still
    in ``generation_token_ids``)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def item_block(item: dict[str, Any]) -> dict[str, Any] | None:
    """The content block of one Responses output item (None: nothing to show, or an item type
    the Messages API has no block for)."""
    kind = item.get("type")
    if kind == "reasoning":
        text = "".join(p.get("text") or "" for p in item.get("content") or [] if isinstance(p, dict))
        return {"type": "thinking", "thinking": text, "signature": thinking_signature(text)} if text else None
    if kind == "message":
        text = "".join(
            (p.get("refusal") if p.get("type") == "refusal" else p.get("text")) or ""
            for p in item.get("content") or []
            if isinstance(p, dict)
        )
        return {"type": "text", "text": text} if text else None
    if kind == "function_call":
        return {
            "type": "tool_use",
            "id": item.get("call_id") or new_id("call"),
            "name": item.get("name") or "",
            "input": tool_input(item.get("arguments")),
        }
    return None


def stop_reason(response: ResponseDict, *, stop_sequence: str | None = None) -> str:
    """The Message's ``stop_reason`` for a Response built from a chat answer (module docstring)."""
    output = response.get("output") or []
    if response.get("status") == "incomplete":
        reason = str((response.get("incomplete_details") or {}).get("reason"))
        return {"content_filter": "refusal", "abort": "pause_turn"}.get(reason, "max_tokens")
    if any(item.get("type") == "function_call" for item in output):
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    refused = any(
        isinstance(p, dict) and p.get("type") == "refusal"
        for item in output
        if item.get("type") == "message"
        for p in item.get("content") or []
    )
    return "refusal" if refused else "end_turn"


def message_usage(usage: Any) -> dict[str, int]:
    """Responses usage → Anthropic ``Usage``: ``input_tokens`` excludes the cached prompt tokens,
    which go in ``cache_read_input_tokens`` (Anthropic: total input = input + cache creation +
    cache read)."""
    usage = usage if isinstance(usage, dict) else {}
    cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": int(usage.get("input_tokens") or 0) - cached,
        "output_tokens": int(usage.get("output_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def training_fields(output: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The training and weight-version fields of a Response's output (they sit on its last item)."""
    fields: dict[str, Any] = {}
    for item in output:
        if any(item.get(f) is not None for f in TRAINING_FIELDS) or any(f in item for f in VERSION_FIELDS):
            fields = {f: item[f] for f in TRAINING_FIELDS if item.get(f) is not None}
            fields.update({f: item[f] for f in VERSION_FIELDS if f in item})
    return fields


def response_to_message(
    response: ResponseDict, *, stop_sequence: str | None = None, message_id: str | None = None
) -> MessageDict:
    """The ``Message`` for a Response built from a chat answer: content blocks from its output
    items, ``stop_reason`` and ``stop_sequence``, usage, and the training fields beside ``content``
    (see the module docstring). ``message_id`` fixes the id (the stream announced it already)."""
    output = response.get("output") or []
    blocks = [block for block in map(item_block, output) if block is not None]
    reason = stop_reason(response, stop_sequence=stop_sequence)
    return {
        "id": message_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": response.get("model") or "",
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
        "usage": message_usage(response.get("usage")),
        **training_fields(output),
    }


def context_exceeded_message(model: str, *, message_id: str | None = None) -> MessageDict:
    """The Message for a prompt that leaves no room to generate: no content, ``stop_reason``
    ``model_context_window_exceeded`` (Anthropic's reason for exactly this), zero usage — so a
    rollout that outgrew the context window ends cleanly instead of failing or retrying (case CL-01,
    as the Responses API's empty ``incomplete`` Response)."""
    return {
        "id": message_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": "model_context_window_exceeded",
        "stop_sequence": None,
        "usage": message_usage(None),
    }


def matched_stop_sequence(choice: Any, stop_sequences: Iterable[str]) -> str | None:
    """The stop sequence a chat choice ended on, when the server says (vLLM puts the matched stop
    string in ``choices[].stop_reason`` beside ``finish_reason: "stop"``); None otherwise."""
    if not isinstance(choice, dict) or choice.get("finish_reason") != "stop":
        return None
    matched = choice.get("stop_reason")
    return matched if isinstance(matched, str) and matched in stop_sequences else None
