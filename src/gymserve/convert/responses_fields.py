"""The request-level fields of a Responses create request in their Chat Completions form (pure).

``responses_to_chat`` uses these for everything but the conversation: sampling params
(``max_output_tokens`` → ``max_tokens``/``max_completion_tokens``, ``top_logprobs`` →
``logprobs`` + ``top_logprobs``, ``reasoning.effort`` → ``reasoning_effort``), ``include``, function
``tools`` (re-nested), ``tool_choice`` and ``text.format`` (→ ``response_format``), following the
OpenAI API reference of both endpoints. Each raises ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from gymserve.convert.options import ConvertOptions
from gymserve.convert.request_checks import (
    function_tool,
    json_type,
    number,
    unsupported_tool_type,
)
from gymserve.errors import InvalidRequestError
from gymserve.protocol import ChatRequest


def _check(request: dict[str, Any], key: str, types: tuple[type, ...], what: str) -> Any:
    value = request.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise InvalidRequestError(f"{key} must be {what}, got {json_type(value)}", param=key)
    return value


# Include values that ask for nothing gymserve could add: results of hosted tools (rejected on
# their own) and encrypted reasoning (it has none to give). Token log-probs have a better home.
_INCLUDE_NOTHING = {
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
}


def check_include(include: Any) -> None:
    """``include`` (OpenAI Responses API values): a list of strings; values that would add nothing
    here are accepted, ``message.output_text.logprobs`` and unknown values are a 400."""
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise InvalidRequestError(f"include must be a list of strings, got {json_type(include)}", param="include")
    for i, value in enumerate(include):
        if value == "message.output_text.logprobs":
            raise InvalidRequestError(
                "include message.output_text.logprobs is not supported; per-token log-probs come as "
                "generation_log_probs on the last output item (local engine; chat backends with "
                "return_token_id_information), or use /v1/chat/completions with logprobs",
                param=f"include[{i}]",
            )
        if value not in _INCLUDE_NOTHING:
            raise InvalidRequestError(f"include[{i}] {value!r} is not a known include value", param=f"include[{i}]")


# Responses fields that mean the same in Chat Completions, numbers: (name, integer?, low, high),
# the ranges the OpenAI API and vLLM both accept. seed, presence_penalty and frequency_penalty are
# not in the Responses API: gymserve carries them as sampling extras, like stop below.
_CARRIED_NUMBERS = (
    ("temperature", False, 0, None),
    ("top_p", False, 0, 1),
    ("presence_penalty", False, -2, 2),
    ("frequency_penalty", False, -2, 2),
    ("seed", True, None, None),
)
# ... and the rest: (name, accepted types, what to say).
_CARRIED = (
    ("user", (str,), "a string"),
    ("metadata", (dict,), "an object"),
    ("stop", (str, list), "a string or a list of strings"),
    ("parallel_tool_calls", (bool,), "a boolean"),
    ("chat_template_kwargs", (dict,), "an object"),  # engine extra (vLLM, SGLang), e.g. enable_thinking
    ("required_prefix_token_ids", (list,), "a list of token IDs"),  # NeMo RL's: the prompt starts with them
)


def copy_sampling(request: dict[str, Any], chat: ChatRequest, options: ConvertOptions) -> None:
    for key, integer, low, high in _CARRIED_NUMBERS:
        value = number(request, key, integer=integer, low=low, high=high)
        if value is not None:
            chat[key] = value
    for key, types, what in _CARRIED:
        if _check(request, key, types, what) is not None:
            chat[key] = request[key]
    max_output = number(request, "max_output_tokens", integer=True, low=1)
    if max_output is not None:
        chat[options.max_tokens_field] = max_output
    top = number(request, "top_logprobs", integer=True, low=0, high=20)
    if top is not None:
        chat["logprobs"] = True
        chat["top_logprobs"] = top
    if _check(request, "stream", (bool,), "a boolean"):
        chat["stream"] = True
        # The Responses stream must end with usage; chat servers send it only when asked.
        chat["stream_options"] = {"include_usage": True}
    reasoning = _check(request, "reasoning", (dict,), "an object")
    if reasoning and reasoning.get("effort") is not None:
        if not isinstance(reasoning["effort"], str):
            raise InvalidRequestError(
                f"reasoning.effort must be a string, got {json_type(reasoning['effort'])}", param="reasoning.effort"
            )
        chat["reasoning_effort"] = reasoning["effort"]


def convert_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses function tools re-nested for chat, checked by the one tool checker both routes use."""
    if not isinstance(tools, list):
        raise InvalidRequestError(f"tools must be an array of tools, got {json_type(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(tool, dict) and kind != "function":
            # Hosted tools run on OpenAI's side; a chat engine has nothing to run them with, so
            # accepting them would silently give the model fewer tools than the caller believes.
            raise unsupported_tool_type(kind, where)
        out.append({"type": "function", "function": function_tool(tool, where, nested=False)})
    return out


def convert_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name is None and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")  # the chat form, sent by mistake but unambiguous
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
        raise InvalidRequestError("tool_choice.name is required", param="tool_choice.name")
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise InvalidRequestError(
        f"tool_choice {kind or choice!r} is not supported; use auto, none, required or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


def convert_text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("text must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("text.format.name is required for json_schema", param="text.format.name")
        if not isinstance(schema, dict):
            raise InvalidRequestError("text.format.schema must be a JSON schema object", param="text.format.schema")
        spec: dict[str, Any] = {"name": name, "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        if fmt.get("description") is not None:
            spec["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequestError(
        f"text.format.type {kind!r} is not supported; use text, json_object or json_schema", param="text.format.type"
    )
