"""Errors in the caller's vocabulary: chat request fields traced back to the Responses request.

A ``/v1/responses`` request is served as a Chat Completions request, so the checks after the
conversion (the local engine's, the chat template's, the prefix splice's) name chat fields:
``messages[3].tool_calls[0].function.arguments``, ``max_tokens``. :class:`FieldPaths` records,
while ``responses_to_chat`` builds each chat message, which input item it came from, and
:meth:`FieldPaths.translate` rewrites such an error's ``param`` and message in Responses terms:
``input[5].arguments``, ``max_output_tokens`` (OpenAI's API reference of both endpoints gives the
correspondence).
"""

from __future__ import annotations

import re

from gymserve.errors import InvalidRequestError

# Chat Completions fields → the Responses field they came from (responses_fields.copy_sampling).
TOP_LEVEL = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "logprobs": "top_logprobs",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
# Within a tool call of an assistant message → within its function_call item.
_CALL_FIELDS = (
    (".function.arguments", ".arguments"),
    (".function.name", ".name"),
    (".function", ""),
    (".id", ".call_id"),
)
_MESSAGE_PATH = re.compile(r"messages\[(\d+)\]((?:\.[A-Za-z_]+|\[\d+\])*)")
_TOOL_PATH = re.compile(r"tools\[(\d+)\]\.function")


class FieldPaths:
    """Where each chat message came from: ``origins[i]`` maps a part of ``messages[i]`` (``""``
    for the message itself, ``content``, ``tool_call_id``, ``tool_calls[j]``, ``reasoning``, a
    training field) to the Responses path it was built from (``input[4]``, ``instructions``)."""

    def __init__(self) -> None:
        self.origins: list[dict[str, str]] = []

    def chat_path(self, path: str) -> str:
        """The Responses path of a chat request path (unchanged when it has no counterpart)."""
        match = _MESSAGE_PATH.fullmatch(path)
        if match is not None:
            return self._message_path(int(match.group(1)), match.group(2))
        head, dot, rest = path.partition(".")
        if head in TOP_LEVEL:
            return TOP_LEVEL[head] + (dot + rest if rest else "")
        if _TOOL_PATH.match(path):
            return _TOOL_PATH.sub(r"tools[\1]", path, count=1)
        if path.startswith("tool_choice.function"):
            return "tool_choice" + path.removeprefix("tool_choice.function")
        return path

    def _message_path(self, i: int, rest: str) -> str:
        if i >= len(self.origins):
            return f"messages[{i}]{rest}"
        origin = self.origins[i]
        rest = rest.removeprefix(".")
        key = max((k for k in origin if k and (rest == k or rest.startswith((k + ".", k + "[")))), key=len, default="")
        base, tail = origin[key] if key else origin[""], rest[len(key) :]
        if key.startswith("tool_calls["):
            for chat, responses in _CALL_FIELDS:
                if tail == chat or tail.startswith(chat + "."):
                    tail = responses + tail[len(chat) :]
                    break
        elif not key and tail:
            tail = "." + tail
        return base + tail

    def translate(self, exc: InvalidRequestError) -> InvalidRequestError:
        """``exc`` with its ``param`` and the paths in its message in Responses terms (the same
        object, so its class, status and code stay)."""
        param = exc.param
        message = _MESSAGE_PATH.sub(lambda m: self._message_path(int(m.group(1)), m.group(2)), exc.message)
        if param is not None:
            new = self.chat_path(param)
            head = param.partition(".")[0]
            if head in TOP_LEVEL and not param.startswith("messages"):
                message = re.sub(rf"(?<![\w.\[]){re.escape(param)}(?![\w])", new, message)
            exc.param = new
        exc.message = message
        exc.args = (message,)
        return exc
