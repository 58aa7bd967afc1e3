"""Anthropic's tool pairing rules for a Messages conversation (pure, no I/O).

Anthropic's Messages API ("Tool use" guide, "Handling tool use and tool result blocks") refuses
with a 400 ``invalid_request_error``:

- a ``tool_use`` block without a ``tool_result`` for its ``id`` in the next user turn ("Each
  ``tool_use`` block must have a corresponding ``tool_result`` block in the next message");
- a ``tool_result`` whose ``tool_use_id`` names no ``tool_use`` of the assistant turn just before
  ("Each ``tool_result`` block must have a corresponding ``tool_use`` block in the previous message");
- a ``tool_result`` after other content in its user turn ("tool result blocks must come FIRST in the
  content array, and any text must come AFTER all tool results").

Consecutive messages of the same role are one turn, as Anthropic combines them. ``check_tool_pairing``
applies the rules on ``/v1/messages`` (and ``count_tokens``) before any backend sees the request, so
a broken history is refused the same way whether it would be converted to chat or forwarded to
Anthropic. A conversation that ends with an assistant ``tool_use`` (nothing answers it yet) passes.
Malformed blocks (no ``id``, not an object) are left to the converters' own checks.
"""

from __future__ import annotations

from typing import Any

from gymserve.errors import InvalidRequestError

Block = tuple[int, int, dict[str, Any]]  # (message index, content index, block)


def _turns(messages: list[Any]) -> list[tuple[str, list[Block], int]]:
    """``(role, blocks, first message index)`` per turn (consecutive messages of one role)."""
    turns: list[tuple[str, list[Block], int]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        content = message.get("content")
        blocks: list[Block] = []
        if isinstance(content, list):
            blocks = [(i, j, b) for j, b in enumerate(content) if isinstance(b, dict)]
        elif isinstance(content, str):
            blocks = [(i, 0, {"type": "text", "text": content})]
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((str(role), blocks, i))
    return turns


def check_tool_pairing(messages: Any) -> None:
    """Raise ``InvalidRequestError`` (400, ``param`` the block: ``messages[i].content[j]``) when
    ``messages`` breaks one of Anthropic's tool pairing rules (module docstring)."""
    if not isinstance(messages, list):
        return
    pending: dict[str, tuple[int, int]] = {}  # tool_use ids of the last assistant turn -> where
    for role, blocks, first in _turns(messages):
        if role == "assistant":  # (never two in a row: consecutive messages of one role are one turn)
            pending = {
                b["id"]: (i, j) for i, j, b in blocks if b.get("type") == "tool_use" and isinstance(b.get("id"), str)
            }
            continue
        if role != "user":
            continue
        answered: set[str] = set()
        other: tuple[int, int] | None = None
        for i, j, b in blocks:
            if b.get("type") != "tool_result":
                other = other or (i, j)
                continue
            at = f"messages[{i}].content[{j}]"
            call_id = b.get("tool_use_id")
            if call_id not in pending:
                raise InvalidRequestError(
                    f"{at}: tool_result block with tool_use_id {call_id!r} has no matching tool_use block in the "
                    "previous assistant message; each tool_result must answer a tool_use of the turn just before it",
                    param=f"{at}.tool_use_id",
                )
            if other is not None:
                raise InvalidRequestError(
                    f"{at}: tool_result blocks must come first in the user message, before any other content "
                    f"(messages[{other[0]}].content[{other[1]}] comes before it)",
                    param=at,
                )
            answered.add(call_id)
        missing = {k: v for k, v in pending.items() if k not in answered}
        if missing:
            _unanswered(missing, first, f"the next user message (messages[{first}]) has no tool_result for it")
        pending = {}


def _unanswered(missing: dict[str, tuple[int, int]], next_at: int, why: str) -> None:
    call_id, (i, j) = next(iter(missing.items()))
    at = f"messages[{i}].content[{j}]"
    raise InvalidRequestError(
        f"{at}: tool_use block {call_id!r} is not answered: {why}; each tool_use must be answered by a "
        "tool_result block with its id in the next user message, before any other content",
        param=at,
    )
