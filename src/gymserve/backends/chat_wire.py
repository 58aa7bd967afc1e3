"""The Chat Completions wire as the chat backend handles it: upstream chunks checked and
normalized before they are forwarded, whole completions replayed as chunks, messages tidied for
the OpenAI client types, training fields kept from clouds that reject them.
"""

from __future__ import annotations

from typing import Any

from gymserve.errors import UpstreamBadResponseError, UpstreamError
from gymserve.protocol import TRAINING_FIELDS, ChatCompletionDict
from gymserve.wire.reasoning import mirror_reasoning


def normalize_tool_call_arguments(message: dict[str, Any]) -> None:
    """Make every ``tool_calls[].function.arguments`` a JSON string (case CR-04: some servers send
    an object or ``""``, which breaks OpenAI clients that ``json.loads`` the field)."""
    from gymserve.convert.chat_to_responses import normalize_arguments

    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            function["arguments"] = normalize_arguments(function.get("arguments"))


def checked_chunk(chunk: Any, where: str, call_index: dict[tuple[int, str], int] | None = None) -> dict[str, Any]:
    """One upstream stream event as a chunk dict, ready to forward: reasoning mirrored into both
    field names (CR-01), each streamed tool call given the ``index`` the OpenAI format requires
    when a server leaves it out — a new ``id`` is a new call, a piece without one continues the
    last call (``call_index`` carries the ids seen between chunks). An error object sent
    mid-stream (vLLM's ``{"object": "error", …}``; the SDK already raises on ``{"error": …}``) or
    an event that is not a JSON object raises ``UpstreamError`` naming ``where``."""
    if not isinstance(chunk, dict):
        raise UpstreamBadResponseError(
            f"{where} sent a stream event that is not a JSON object: {str(chunk)[:200]}", url=where
        )
    if chunk.get("object") == "error" or (isinstance(chunk.get("error"), dict) and "choices" not in chunk):
        raw_error = chunk.get("error")
        error: dict[Any, Any] = raw_error if isinstance(raw_error, dict) else chunk
        raise UpstreamError(
            f"{where} failed mid-stream: {error.get('message') or error}", url=where, code="upstream_error"
        )
    seen = call_index if call_index is not None else {}
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            continue
        mirror_reasoning(delta)
        n = choice.get("index", 0) if isinstance(choice.get("index", 0), int) else 0
        for tc in delta.get("tool_calls") or []:
            if not isinstance(tc, dict) or isinstance(tc.get("index"), int):
                continue
            call_id = tc.get("id")
            if isinstance(call_id, str) and call_id:
                seen.setdefault((n, call_id), sum(1 for c, _ in seen if c == n))
                tc["index"] = seen[(n, call_id)]
            else:  # no id: more of the call this choice started last
                tc["index"] = max((i for (c, _), i in seen.items() if c == n), default=0)
    return chunk


def completion_to_chunks(completion: ChatCompletionDict) -> list[dict[str, Any]]:
    """A whole ``ChatCompletion`` as two ``ChatCompletionChunk`` dicts: the full delta, then the
    finish reason with usage (training fields ride on the first delta)."""
    head = {
        "id": completion.get("id"),
        "object": "chat.completion.chunk",
        "created": completion.get("created"),
        "model": completion.get("model"),
    }
    choice = completion["choices"][0]
    delta = {k: v for k, v in (choice.get("message") or {}).items() if v is not None}
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(delta["tool_calls"])]
    return [
        {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice.get("logprobs")}]},
        {
            **head,
            "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason")}],
            "usage": completion.get("usage"),
        },
    ]


def strip_training_fields(obj: Any) -> Any:
    """A copy of a request without gymserve's training fields on messages/items (clouds reject them)."""
    if isinstance(obj, list):
        return [strip_training_fields(x) for x in obj]
    if isinstance(obj, dict):
        return {k: strip_training_fields(v) for k, v in obj.items() if k not in TRAINING_FIELDS}
    return obj
