"""One model turn of a conversation history as the chat assistant message it becomes (pure).

Both history converters (``responses_to_chat``: reasoning, message and function_call items;
``messages_to_chat``: an assistant message's thinking, text and tool_use blocks) gather a turn's
pieces in the order they come and then write it the same way: texts joined with a blank line,
reasoning rendered per ``ConvertOptions.reasoning_mode``, tool calls kept, training fields on the
message (where the prefix splice reads them). A turn's training fields are read with
:func:`token_info_at`, which names where they were in the caller's request.
"""

from __future__ import annotations

from typing import Any

from gymserve.convert.options import ConvertOptions
from gymserve.errors import InvalidRequestError
from gymserve.protocol import TokenInfo, get_token_info
from gymserve.wire.reasoning import REASONING_FIELDS
from gymserve.wire.think import think_block


def new_turn() -> dict[str, Any]:
    """An empty turn: ``texts``, ``reasoning`` (lists of str), ``tool_calls`` (chat tool calls),
    ``tokens`` (a ``protocol.TokenInfo`` or None)."""
    return {"texts": [], "reasoning": [], "tool_calls": [], "tokens": None}


def assistant_message(turn: dict[str, Any], options: ConvertOptions) -> dict[str, Any]:
    """The chat assistant message of ``turn``: ``content`` the texts joined with a blank line (None
    when empty); reasoning as ``<think>`` tags before the content, in the ``reasoning_content`` /
    ``reasoning`` field, or dropped (``options.reasoning_mode``); ``tool_calls``; training fields."""
    content = "\n\n".join(turn["texts"]) or None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning = "\n\n".join(turn["reasoning"])
    mode = options.reasoning_mode
    if reasoning and mode == "think_tags":
        message["content"] = think_block(reasoning) + (content or "")
    elif reasoning and mode in REASONING_FIELDS:
        message[mode] = reasoning
    if turn["tool_calls"]:
        message["tool_calls"] = turn["tool_calls"]
    if turn["tokens"] is not None:
        message.update(turn["tokens"])
    return message


def token_info_at(obj: dict[str, Any], where: str, *, deep: bool = True) -> TokenInfo | None:
    """``protocol.get_token_info(obj, deep=deep)``, its ``InvalidRequestError`` naming ``where``
    (``input[3]: generation_log_probs has …``, param ``input[3].generation_log_probs``)."""
    try:
        return get_token_info(obj, deep=deep)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{where}: {e.message}", param=f"{where}.{e.param}") from None
