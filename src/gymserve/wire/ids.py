"""Minting ids in the formats the OpenAI APIs use, so clients that check them keep working.

``new_id(kind)``: ``chatcmpl-`` + 32 hex for a chat completion (and its chunks), ``cmpl-`` + 32 hex
for a (legacy) completion, as vLLM names them; ``call_`` + 24 hex
for a tool call (``tool_calls[].id``, a Responses ``call_id``); ``resp_``, ``msg_``, ``rs_`` and
``fc_`` + 32 hex for a Response and its message, reasoning and function-call items. Random (UUID4),
never derived from the request.
"""

from __future__ import annotations

import uuid

_FORMATS = {
    "chatcmpl": ("chatcmpl-", 32),
    "cmpl": ("cmpl-", 32),
    "call": ("call_", 24),
    "resp": ("resp_", 32),
    "msg": ("msg_", 32),
    "rs": ("rs_", 32),
    "fc": ("fc_", 32),
}


def new_id(kind: str) -> str:
    """A fresh id of ``kind`` (one of ``chatcmpl``, ``cmpl``, ``call``, ``resp``, ``msg``, ``rs``, ``fc``);
    ``KeyError`` for another kind."""
    prefix, length = _FORMATS[kind]
    return prefix + uuid.uuid4().hex[:length]
