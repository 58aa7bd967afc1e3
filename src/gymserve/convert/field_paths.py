"""Errors in the caller's vocabulary: chat request fields traced back to the request as sent.

A ``/v1/responses`` or ``/v1/messages`` request is served as a Chat Completions request, so the
checks after the conversion (the local engine's, the chat template's, the prefix splice's) name
chat fields: ``messages[3].tool_calls[0].function.arguments``, ``max_tokens``, ``stop``.
:class:`FieldPaths` records, while ``responses_to_chat`` / ``messages_to_chat`` build each chat
message, which input item or message (block) it came from, and :meth:`FieldPaths.translate`
rewrites such an error's ``param`` and message in the caller's terms: ``input[5].arguments``,
``max_output_tokens`` (OpenAI's API reference of both endpoints gives the correspondence);
``messages[1].content[2].input``, ``stop_sequences`` (Anthropic's Messages API reference, and the
conversion rules of ``messages_to_chat``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gymserve.errors import InvalidRequestError


@dataclass(frozen=True)
class Vocabulary:
    """How one API names what the chat request calls otherwise.

    ``top_level``: chat request field → the caller's. ``call_fields``: within a tool call of an
    assistant message → within what it came from (a ``function_call`` item, a ``tool_use`` block).
    ``tool_fields``: within ``tools[i].function`` → within the caller's ``tools[i]``."""

    top_level: dict[str, str]
    call_fields: tuple[tuple[str, str], ...]
    tool_fields: tuple[tuple[str, str], ...] = ()


# OpenAI's Responses API (responses_fields.copy_sampling gives the correspondence).
RESPONSES = Vocabulary(
    top_level={
        "messages": "input",
        "max_tokens": "max_output_tokens",
        "max_completion_tokens": "max_output_tokens",
        "logprobs": "top_logprobs",
        "response_format": "text.format",
        "reasoning_effort": "reasoning.effort",
    },
    call_fields=(
        (".function.arguments", ".arguments"),
        (".function.name", ".name"),
        (".function", ""),
        (".id", ".call_id"),
    ),
)
# Anthropic's Messages API (messages_fields.copy_sampling, messages_to_chat._tool_use).
MESSAGES = Vocabulary(
    top_level={
        "max_completion_tokens": "max_tokens",
        "stop": "stop_sequences",
        "response_format": "output_config.format",
        "reasoning_effort": "output_config.effort",
        "user": "metadata.user_id",
        "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    },
    call_fields=((".function.arguments", ".input"), (".function.name", ".name"), (".function", "")),
    tool_fields=((".parameters", ".input_schema"),),
)
_MESSAGE_PATH = re.compile(r"messages\[(\d+)\]((?:\.[A-Za-z_]+|\[\d+\])*)")
_TOOL_PATH = re.compile(r"(tools\[\d+\])\.function((?:\.[A-Za-z_]+|\[\d+\])*)")


class FieldPaths:
    """Where each chat message came from: ``origins[i]`` maps a part of ``messages[i]`` (``""``
    for the message itself, ``content``, ``tool_call_id``, ``tool_calls[j]``, ``reasoning``, a
    training field) to the caller's path it was built from (``input[4]``, ``instructions``,
    ``messages[2].content[1]``, ``system``). ``vocabulary``: the caller's API (:data:`RESPONSES`,
    :data:`MESSAGES`)."""

    def __init__(self, vocabulary: Vocabulary = RESPONSES) -> None:
        self.vocabulary = vocabulary
        self.origins: list[dict[str, str]] = []

    def chat_path(self, path: str) -> str:
        """The caller's path of a chat request path (unchanged when it has no counterpart)."""
        match = _MESSAGE_PATH.fullmatch(path)
        if match is not None:
            return self._message_path(int(match.group(1)), match.group(2))
        head, dot, rest = path.partition(".")
        if head in self.vocabulary.top_level:
            return self.vocabulary.top_level[head] + (dot + rest if rest else "")
        match = _TOOL_PATH.fullmatch(path)
        if match is not None:
            return match.group(1) + _renamed(match.group(2), self.vocabulary.tool_fields)
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
            tail = _renamed(tail, self.vocabulary.call_fields)
        elif not key and tail:
            tail = "." + tail
        return base + tail

    def translate(self, exc: InvalidRequestError) -> InvalidRequestError:
        """``exc`` with its ``param`` and the paths in its message in the caller's terms (the same
        object, so its class, status and code stay)."""
        param = exc.param
        message = _MESSAGE_PATH.sub(lambda m: self._message_path(int(m.group(1)), m.group(2)), exc.message)
        if param is not None:
            new = self.chat_path(param)
            head = param.partition(".")[0]
            if head in self.vocabulary.top_level and not param.startswith("messages"):
                message = re.sub(rf"(?<![\w.\[]){re.escape(param)}(?![\w])", new, message)
            exc.param = new
        exc.message = message
        exc.args = (message,)
        return exc


def _renamed(tail: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``tail`` (``.function.name``, ``.parameters.type``) with its first matching head renamed."""
    for chat, caller in renames:
        if tail == chat or tail.startswith((chat + ".", chat + "[")):
            return caller + tail[len(chat) :]
    return tail
