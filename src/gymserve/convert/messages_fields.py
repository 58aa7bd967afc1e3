"""The request-level fields of a Messages create request in their Chat Completions form (pure).

``messages_to_chat`` uses these for everything but the conversation, following Anthropic's Messages
API reference ("Create a Message") and, where the chat side needs a choice, vLLM's Messages
endpoint: ``check_top_level`` (the OpenAI APIs' fields, Anthropic's server-side features),
``copy_sampling`` (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``,
``metadata.user_id``, ``output_config``), ``convert_tools`` and ``convert_tool_choice``. Each raises
``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from gymserve.convert.options import ConvertOptions
from gymserve.convert.request_checks import json_type, number
from gymserve.errors import InvalidRequestError
from gymserve.protocol import ChatRequest

# Features Anthropic runs on its side, which would silently change the answer if ignored.
_SERVER_SIDE = {
    "container": "code-execution containers run on Anthropic's side; gymserve has none",
    "mcp_servers": "the MCP connector runs on Anthropic's side; give the tools as client tools",
}
# Fields of the OpenAI APIs sent here by mistake: what the Messages API calls them.
_OTHER_API = {
    "max_completion_tokens": "use max_tokens",
    "max_output_tokens": "use max_tokens",
    "stop": "use stop_sequences (a list of strings)",
    "input": 'use messages: a list of {"role": "user" | "assistant", "content": ...} messages',
    "instructions": "use system",
    "response_format": 'use output_config: {"format": {"type": "json_schema", "schema": {...}}}',
    "reasoning_effort": 'use output_config: {"effort": "low" | "medium" | "high"}',
    "reasoning": 'use output_config: {"effort": ...}',
    "text": 'use output_config: {"format": ...}',
    "n": "the Messages API makes one message per request; send n requests",
    "logprobs": "the sampled tokens' log-probs come as generation_log_probs on the message",
    "top_logprobs": "not available on /v1/messages; use /v1/chat/completions for alternatives",
    "parallel_tool_calls": 'use tool_choice: {"type": "auto", "disable_parallel_tool_use": true}',
    "user": 'use metadata: {"user_id": ...}',
    "seed": "the Messages API has no seed; the local backend pins one in the server config (sampling.seed)",
}


def check_top_level(request: dict[str, Any]) -> None:
    """Refuse a field of the OpenAI APIs (naming the Messages field to use) and Anthropic's
    server-side features; other unknown fields are left for the caller to ignore."""
    for key in request:
        if key in _OTHER_API:
            raise InvalidRequestError(
                f"{key} is not a Messages API field: on POST /v1/messages, {_OTHER_API[key]}",
                param=key,
                code="unsupported_parameter",
            )
        if key in _SERVER_SIDE:
            raise InvalidRequestError(f"{key}: {_SERVER_SIDE[key]}", param=key, code="unsupported_parameter")


def of_type(obj: dict[str, Any], key: str, kind: type, what: str, where: str | None = None) -> Any:
    """``obj[key]`` (None when absent) checked to be a ``kind``; ``where`` names it in the error."""
    value = obj.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool)):
        path = where or key
        raise InvalidRequestError(f"{path} must be {what}, got {json_type(value)}", param=path)
    return value


def copy_sampling(request: dict[str, Any], chat: ChatRequest, options: ConvertOptions) -> None:
    if request.get("max_tokens") is None:
        raise InvalidRequestError(
            "max_tokens is required: the most tokens to generate (an integer, at least 1)", param="max_tokens"
        )
    chat[options.max_tokens_field] = number(request, "max_tokens", integer=True, low=1)
    for key, integer, low, high in (("temperature", False, 0, 1), ("top_p", False, 0, 1), ("top_k", True, 0, None)):
        if number(request, key, integer=integer, low=low, high=high) is not None:
            chat[key] = request[key]
    stop = request.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError(
                f"stop_sequences must be a list of strings, got {json_type(stop)}", param="stop_sequences"
            )
        if stop:
            chat["stop"] = list(stop)
    metadata = of_type(request, "metadata", dict, "an object")
    if metadata is not None and of_type(metadata, "user_id", str, "a string", "metadata.user_id"):
        chat["user"] = metadata["user_id"]
    config = of_type(request, "output_config", dict, "an object")
    if config is not None:
        _output_config(config, chat)
    of_type(request, "stream", bool, "true or false")


def _output_config(config: dict[str, Any], chat: ChatRequest) -> None:
    effort = of_type(config, "effort", str, "a string", "output_config.effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError(
                'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format"
            )
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def convert_tools(tools: Any) -> list[dict[str, Any]]:
    """Messages client tools (``name``, ``description``, ``input_schema``; ``type`` absent or
    ``"custom"``) as Chat Completions function tools. Raises ``InvalidRequestError`` for a tool
    without a name or with an ``input_schema`` that is not a JSON Schema object, and for server
    tools (``web_search_20250305``, ``bash_20250124``...), which run on Anthropic's side."""
    if not isinstance(tools, list):
        raise InvalidRequestError(f"tools must be an array of tools, got {json_type(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where} must be an object, got {json_type(tool)}", param=where)
        kind = tool.get("type")
        if ("function" in tool or "parameters" in tool) and "input_schema" not in tool:
            raise InvalidRequestError(
                f"{where}.input_schema is required (this looks like an OpenAI tool; the Messages API puts name, "
                'description and input_schema on the tool itself: {"name": ..., "input_schema": {...}})',
                param=f"{where}.input_schema",
            )
        if kind not in (None, "custom"):
            raise InvalidRequestError(
                f"{where}.type {kind!r} is not supported: only client tools (name, description, input_schema) "
                "can be given to this model; server tools run on Anthropic's side",
                param=f"{where}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.name is required (a non-empty string)", param=f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{where}.input_schema must be a JSON Schema object, got {json_type(schema)}, e.g. "
                '{"type": "object", "properties": {"city": {"type": "string"}}}',
                param=f"{where}.input_schema",
            )
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise InvalidRequestError(
                    f"{where}.description must be a string, got {json_type(description)}",
                    param=f"{where}.description",
                )
            function["description"] = description
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def convert_tool_choice(choice: Any, chat: ChatRequest) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("tool_choice.name is required for type tool", param="tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in ("auto", "any", "none"):
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        hint = " (the Messages API takes an object, not a string)" if isinstance(choice, str) else ""
        raise InvalidRequestError(
            f'tool_choice must be one of {{"type": "auto"}}, {{"type": "any"}}, '
            f'{{"type": "tool", "name": ...}} or {{"type": "none"}}{hint}',
            param="tool_choice",
        )
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise InvalidRequestError(
            "tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice.disable_parallel_tool_use"
        )
    if disable:
        chat["parallel_tool_calls"] = False
