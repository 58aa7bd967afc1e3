"""Chat Completions messages checked as strictly as Responses input items (pure, no I/O).

``request_checks.check_request`` runs :func:`check_messages` on the chat route; other routes that
take chat-shaped messages reuse it, so every endpoint refuses the same malformed message with the
same words. :func:`json_type` names a value's JSON type in every check's messages.
"""

from __future__ import annotations

from typing import Any

from gymserve.errors import InvalidRequestError


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, with an article ("a string", "an object", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")


def check_messages(messages: list[Any], where: str = "messages") -> None:
    """Chat Completions ``messages`` checked as strictly as the Responses converter checks input
    items (OpenAI's "Create chat completion" reference gives the shapes).

    Raises ``InvalidRequestError`` naming the field (``messages[2].tool_call_id``) for: a message
    that is not an object; a missing or unknown ``role`` (``function``, deprecated by OpenAI, is
    told to use ``tool``); missing ``content`` on a system, developer, user or tool message;
    ``content`` that is neither a string nor a list of part objects with a ``type`` (text parts
    need a string ``text``); a ``tool`` message without a non-empty ``tool_call_id``; ``tool_calls``
    that is not a list of ``{"id", "type": "function", "function": {"name", "arguments"}}`` with a
    non-empty ``id`` and ``name`` and ``arguments`` a JSON string (or an object, which gymserve
    also accepts). ``where`` names the list in errors.
    """
    for i, msg in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{at} must be a message object, got {json_type(msg)}", param=at)
        role = msg.get("role")
        if role not in MESSAGE_ROLES:
            hint = " (deprecated by OpenAI: send a tool message with tool_call_id)" if role == "function" else ""
            problem = "is required" if role is None else f"{role!r} is not a role{hint}"
            raise InvalidRequestError(f"{at}.role {problem}: use {', '.join(MESSAGE_ROLES)}", param=f"{at}.role")
        content = msg.get("content")
        if content is None and role != "assistant":
            raise InvalidRequestError(
                f"{at}.content is required for a {role} message: a string or a list of content parts",
                param=f"{at}.content",
            )
        _check_content(content, f"{at}.content")
        if role == "tool":
            _required_string(msg, "tool_call_id", at, "a tool message answers the assistant's tool call with that id")
        if role == "assistant" and msg.get("tool_calls") is not None:
            _check_tool_calls(msg["tool_calls"], f"{at}.tool_calls")


def _required_string(obj: dict[str, Any], key: str, at: str, why: str) -> None:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        got = "" if value is None else f", got {'an empty string' if value == '' else json_type(value)}"
        raise InvalidRequestError(f"{at}.{key} is required (a non-empty string){got}: {why}", param=f"{at}.{key}")


def _check_content(content: Any, at: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{at} must be a string or a list of content parts, got {json_type(content)}", param=at
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequestError(
                f'{at}[{j}] must be a content part object with a type, e.g. {{"type": "text", "text": "..."}}',
                param=f"{at}[{j}]",
            )
        key = "refusal" if part["type"] == "refusal" else "text"
        if part["type"] in _TEXT_PART_TYPES and not isinstance(part.get(key), str):
            raise InvalidRequestError(
                f"{at}[{j}].{key} must be a string, got {json_type(part.get(key))}", param=f"{at}[{j}].{key}"
            )


def _check_tool_calls(calls: Any, at: str) -> None:
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{at} must be a list of tool calls, got {json_type(calls)}", param=at)
    for j, call in enumerate(calls):
        where = f"{at}[{j}]"
        if not isinstance(call, dict):
            raise InvalidRequestError(f"{where} must be a tool call object, got {json_type(call)}", param=where)
        _required_string(call, "id", where, "the tool message that answers the call names it in tool_call_id")
        if call.get("type", "function") != "function":
            raise InvalidRequestError(
                f'{where}.type must be "function", got {call.get("type")!r}', param=f"{where}.type"
            )
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(
                f'{where}.function is required: {{"name": ..., "arguments": "{{...}}"}}', param=f"{where}.function"
            )
        _required_string(fn, "name", f"{where}.function", "the function the model called")
        arguments = fn.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, dict)):
            raise InvalidRequestError(
                f"{where}.function.arguments must be a JSON string, got {json_type(arguments)}",
                param=f"{where}.function.arguments",
            )
