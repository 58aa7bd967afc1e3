"""Request checks shared by ``POST /v1/responses`` and ``POST /v1/chat/completions`` (pure, no I/O).

The two OpenAI APIs name the same things differently (``max_output_tokens`` / ``max_tokens``,
``input`` / ``messages``, ``text.format`` / ``response_format``; see OpenAI's API reference for
"Create a model response" and "Create chat completion"). A client that sends one API's field to the
other route would otherwise have it ignored without a word (no output cap at all for
``max_tokens`` on Responses), so such a field is a 400 that names the field to use instead
(``code: unsupported_parameter``, as the OpenAI API answers for parameters it does not take).

Rules, and where they come from:

- ``null`` for an optional top-level field means the same as leaving it out, as in the OpenAI API
  (the SDK's types are ``Optional``; NeMo Gym's task rows send ``"model": null``).
- Function tools are checked by one function for both shapes (Responses' flat
  ``{"type": "function", "name", "parameters"}`` and Chat Completions' nested
  ``{"type": "function", "function": {...}}``), with the same words; only the path differs.
- Numbers: a wrong type says what was expected and what came; a value outside the range the OpenAI
  API and vLLM both accept says "out of range" with the range.

Fields gymserve carries as documented extensions on ``/v1/responses`` (``seed``, ``stop``,
``presence_penalty``, ``frequency_penalty``, ``chat_template_kwargs``: sampling params a chat server
or the local engine honours) are not refused here.
"""

from __future__ import annotations

from typing import Any, Literal

from gymserve.convert.message_checks import check_messages, json_type
from gymserve.errors import InvalidRequestError

Api = Literal["responses", "chat"]

_ROUTE = {"responses": "POST /v1/responses", "chat": "POST /v1/chat/completions"}
_API_NAME = {"responses": "Responses API", "chat": "Chat Completions"}

_NO_COUNTERPART_CHAT = "it has no counterpart in the Responses API; send it to /v1/chat/completions instead"
_NO_COUNTERPART_RESPONSES = "it has no counterpart in Chat Completions; send it to /v1/responses instead"
_STATELESS = "Chat Completions is stateless: send the whole conversation in messages"

# Chat Completions fields that the Responses API does not take: what to send instead.
_CHAT_ONLY: dict[str, str] = {
    "messages": 'use input: a string, or a list of input items ({"role": ..., "content": ...} '
    "messages are valid input items)",
    "max_tokens": "use max_output_tokens",
    "max_completion_tokens": "use max_output_tokens",
    "n": "the Responses API makes one response per request; send n requests",
    "logprobs": "use top_logprobs (0-20) for alternatives; the sampled tokens' log-probs come as "
    "generation_log_probs on the last output item",
    "response_format": 'use text.format, e.g. {"format": {"type": "json_schema", "name": ..., "schema": {...}}}',
    "reasoning_effort": 'use reasoning.effort, e.g. {"effort": "low"}',
    "functions": 'use tools: [{"type": "function", "name": ..., "parameters": {...}}]',
    "function_call": "use tool_choice",
    "verbosity": "use text.verbosity",
    "logit_bias": _NO_COUNTERPART_CHAT,
    "modalities": _NO_COUNTERPART_CHAT,
    "audio": _NO_COUNTERPART_CHAT,
    "prediction": _NO_COUNTERPART_CHAT,
    "web_search_options": _NO_COUNTERPART_CHAT,
}

# Responses API fields that Chat Completions does not take: what to send instead.
_RESPONSES_ONLY: dict[str, str] = {
    "input": 'use messages: a list of {"role": ..., "content": ...} messages',
    "instructions": "put them in a system message at the start of messages",
    "max_output_tokens": "use max_completion_tokens (or max_tokens)",
    "text": "use response_format for text.format (and verbosity for text.verbosity)",
    "reasoning": 'use reasoning_effort, e.g. "low"',
    "previous_response_id": _STATELESS,
    "conversation": _STATELESS,
    "include": _NO_COUNTERPART_RESPONSES,
    "truncation": _NO_COUNTERPART_RESPONSES,
    "max_tool_calls": _NO_COUNTERPART_RESPONSES,
    "background": _NO_COUNTERPART_RESPONSES,
}

_OTHER_API_FIELDS = {"responses": _CHAT_ONLY, "chat": _RESPONSES_ONLY}
_OTHER_API = {"responses": "chat", "chat": "responses"}

# (key, integer?, low, high) for the chat route: ranges the OpenAI API and vLLM both accept.
_CHAT_NUMBERS = (
    ("max_tokens", True, 1, None),
    ("max_completion_tokens", True, 1, None),
    ("n", True, 1, None),
    ("temperature", False, 0, None),
    ("top_p", False, 0, 1),
    ("top_logprobs", True, 0, 20),
    ("presence_penalty", False, -2, 2),
    ("frequency_penalty", False, -2, 2),
    ("seed", True, None, None),
)


INT_MAX = 2**63 - 1
"""The largest integer a request field may hold: JSON parsers in most languages (and numpy, and
vLLM's sampling params on their way to C++) keep integers in 64 bits."""


def number(
    obj: dict[str, Any],
    key: str,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    where: str | None = None,
) -> int | float | None:
    """``obj[key]`` checked as a JSON number (``integer``: a whole number) within ``[low, high]``.

    Returns the value (None when absent or null); for ``integer``, a whole number written with a
    decimal point or exponent (``3.0``, ``1e3``: JSON has one number type) as an ``int``. Raises
    ``InvalidRequestError`` (param ``where`` or ``key``): "must be an integer, got a string" for a
    wrong type (booleans are not numbers) or a fractional number, and "``key=value`` is out of
    range: it must be ..." for a value outside the bounds; integers are also bounded by
    :data:`INT_MAX` (``max_output_tokens: 1e30`` is out of range, not "not an integer").
    """
    value = obj.get(key)
    if value is None:
        return None
    path = where or key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(
            f"{path} must be {'an integer' if integer else 'a number'}, got {json_type(value)}"
            f"{'' if isinstance(value, (dict, list)) else f' ({value!r})'}",
            param=path,
        )
    if value != value:  # NaN: Python's json reads it, but it is no number
        raise InvalidRequestError(f"{path} must be a number, got NaN", param=path)
    if integer:
        if not -INT_MAX - 1 <= value <= INT_MAX:  # inf included
            raise InvalidRequestError(
                f"{path}={value!r} is out of range: it must be a 64-bit integer, at most {INT_MAX}", param=path
            )
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, float):
            raise InvalidRequestError(f"{path} must be an integer, got a number ({value!r})", param=path)
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            bound = f"at least {low}"
        elif low is None:
            bound = f"at most {high}"
        else:
            bound = f"from {low} to {high}"
        raise InvalidRequestError(f"{path}={value!r} is out of range: it must be {bound}", param=path)
    return value


def required_str(obj: dict[str, Any], key: str, where: str) -> str:
    """``obj[key]`` checked as a non-empty string; raises ``InvalidRequestError`` (param
    ``where.key``): "``where.key`` is required (a non-empty string), got …"."""
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        got = "" if value is None else f", got {json_type(value) if not isinstance(value, str) else 'an empty string'}"
        raise InvalidRequestError(f"{where}.{key} is required (a non-empty string){got}", param=f"{where}.{key}")
    return value


def without_nulls(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` without its top-level ``null`` fields (a new dict only when there are some)."""
    if any(v is None for v in request.values()):
        return {k: v for k, v in request.items() if v is not None}
    return request


def check_request(request: Any, api: Api) -> dict[str, Any]:
    """The checks every backend shares for one route; returns the request without its top-level nulls.

    ``api``: ``"responses"`` (``POST /v1/responses``) or ``"chat"`` (``POST /v1/chat/completions``).
    Raises ``InvalidRequestError`` (400, ``param`` naming the field) for: a body that is not an
    object; a field of the other API (``code: unsupported_parameter``, the message names the field
    to use); a ``model`` that is not a string. On the chat route also: ``messages`` missing or not a
    non-empty list or holding a malformed message (``check_messages``: as strict as the Responses
    converter is with input items), numbers of the wrong type or out of range, malformed function
    tools (``chat_tools``). Items, content and tools of Responses requests are checked by the converter
    (``responses_to_chat``) or the native upstream.
    """
    if not isinstance(request, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {json_type(request)}")
    request = without_nulls(request)
    wrong = _OTHER_API_FIELDS[api]
    for key in request:
        if key in wrong:
            raise InvalidRequestError(
                f"{key} is a {_API_NAME[_OTHER_API[api]]} field, not a {_API_NAME[api]} one: on "
                f"{_ROUTE[api]}, {wrong[key]}",
                param=key,
                code="unsupported_parameter",
            )
    if "model" in request and not isinstance(request["model"], str):
        raise InvalidRequestError(f"model must be a string, got {json_type(request['model'])}", param="model")
    if api == "chat":
        messages = request.get("messages")
        if messages is None:
            raise InvalidRequestError(
                'messages is required: a non-empty list of {"role": ..., "content": ...} messages', param="messages"
            )
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError(
                f"messages must be a non-empty list of messages, got "
                f"{'an empty array' if messages == [] else json_type(messages)}",
                param="messages",
            )
        check_messages(messages)
        for key, integer, low, high in _CHAT_NUMBERS:
            value = number(request, key, integer=integer, low=low, high=high)
            if value is not None and value is not request[key]:
                request = {**request, key: value}  # 3.0 sent for an integer field goes on as 3
        if "logprobs" in request and not isinstance(request["logprobs"], bool):
            raise InvalidRequestError(
                f"logprobs must be a boolean, got {json_type(request['logprobs'])}", param="logprobs"
            )
        chat_tools(request.get("tools"), functions_only=False)
    return request


# -- tools ------------------------------------------------------------------------------------


def function_tool(tool: Any, where: str, *, nested: bool) -> dict[str, Any]:
    """One function tool checked, as the chat ``function`` object (``name``, ``description``,
    ``parameters``, ``strict``; absent or null ones left out).

    ``nested``: the Chat Completions shape (the function under ``tool["function"]``) rather than the
    Responses shape (its fields on the tool itself). ``where`` names the tool (``tools[0]``).
    Raises ``InvalidRequestError`` naming the field: a missing or empty ``name``, a ``description``
    that is not a string, ``parameters`` that is not a JSON Schema object (e.g. the string
    ``"city: string"``), a ``strict`` that is not a boolean; a tool written in the other API's
    shape is told the shape this route wants.
    """
    if not isinstance(tool, dict):
        raise InvalidRequestError(f"{where} must be an object, got {json_type(tool)}", param=where)
    if nested:
        fn, at = tool.get("function"), f"{where}.function"
        if fn is None:
            flat = (
                " (this looks like a Responses API tool; Chat Completions nests name, description and "
                "parameters under function)"
                if "name" in tool
                else ""
            )
            raise InvalidRequestError(
                f'{at} is required: {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}{flat}',
                param=at,
            )
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{at} must be an object, got {json_type(fn)}", param=at)
    else:
        fn, at = tool, where
        if "name" not in tool and isinstance(tool.get("function"), dict):
            raise InvalidRequestError(
                f"{where}.name is required (this looks like a Chat Completions tool; the Responses API puts "
                'name, description and parameters on the tool itself: {"type": "function", "name": ..., '
                '"parameters": {...}})',
                param=f"{where}.name",
            )
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        got = (
            "" if name is None else f", got {json_type(name)}" if not isinstance(name, str) else ", got an empty string"
        )
        raise InvalidRequestError(f"{at}.name is required (a non-empty string){got}", param=f"{at}.name")
    out: dict[str, Any] = {"name": name}
    for key, ok, what in (
        ("description", str, "a string"),
        ("parameters", dict, "a JSON Schema object"),
        ("strict", bool, "a boolean"),
    ):
        value = fn.get(key)
        if value is None:
            continue
        if not isinstance(value, ok):
            hint = (
                ', e.g. {"type": "object", "properties": {"city": {"type": "string"}}}' if key == "parameters" else ""
            )
            raise InvalidRequestError(f"{at}.{key} must be {what}, got {json_type(value)}{hint}", param=f"{at}.{key}")
        out[key] = value
    return out


def chat_tools(tools: Any, *, functions_only: bool) -> list[dict[str, Any]] | None:
    """Chat Completions ``tools`` checked (None when absent); every ``type: function`` entry by
    ``function_tool``.

    ``functions_only``: refuse other tool types (OpenAI's ``custom`` tools) as a backend that can
    only run function tools must; otherwise they are left for the upstream to judge.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError(f"tools must be an array of tools, got {json_type(tools)}", param="tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function" or not isinstance(tool, dict):
            function_tool(tool, where, nested=True)
        elif functions_only:
            raise unsupported_tool_type(kind, where)
    return tools or None


def unsupported_tool_type(kind: Any, where: str) -> InvalidRequestError:
    """The 400 for a tool that is not a function tool, on a backend that runs only function tools."""
    if kind is None:
        return InvalidRequestError(f'{where}.type is required: "function"', param=f"{where}.type")
    return InvalidRequestError(
        f"{where}.type {kind!r} is not supported: only function tools can be given to "
        'this model ({"type": "function", ...}); hosted tools run on OpenAI\'s side',
        param=f"{where}.type",
    )
