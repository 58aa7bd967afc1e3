"""A Messages API event stream folded into the Message it announces (for tests that read streams
without the anthropic SDK's helper)."""

from __future__ import annotations

import json
from typing import Any


def assemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The Message a Messages event stream describes, folded as Anthropic's "Streaming Messages"
    page says a client must (``message_start``'s Message, blocks by index, the ``message_delta``'s
    stop reason, usage and — gymserve's — training fields); raises on an ``error`` event."""
    message: dict[str, Any] | None = None
    partial: dict[int, str] = {}
    for event in events:
        kind = event["type"]
        if kind == "error":
            raise RuntimeError(f"stream error: {event['error']}")
        if kind == "message_start":
            message = json.loads(json.dumps(event["message"]))
            continue
        assert message is not None, f"{kind} before message_start"
        if kind == "content_block_start":
            assert event["index"] == len(message["content"])
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and event["index"] in partial:
            message["content"][event["index"]]["input"] = json.loads(partial[event["index"]])
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"] = {**message["usage"], **event["usage"]}
            message.update({k: v for k, v in event.items() if k not in ("type", "delta", "usage")})
    assert message is not None
    return message
