"""Responses create request → Chat Completions create request (pure, no I/O)."""

from __future__ import annotations

import json
from typing import Any

from gymserve.convert.options import ConvertOptions
from gymserve.errors import InvalidRequestError
from gymserve.protocol import ChatRequest, ResponsesRequest, get_token_info

# Tool types the Responses API runs on OpenAI's side; a chat engine has nothing to run them with, so
# accepting them would silently give the model fewer tools than the caller believes it has.
_HOSTED_TOOL_HINT = "only function tools are supported by chat backends"

_TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def responses_to_chat(request: ResponsesRequest, options: ConvertOptions | None = None) -> ChatRequest:
    """Translate a Responses create request into a Chat Completions create request.

    Input: a ``ResponseCreateParams``-shaped dict (``input`` a string or a list of items; items may
    omit ``type`` when they have ``role``, as the OpenAI API allows). Output: a
    ``CompletionCreateParams``-shaped dict (``model``, ``messages``, sampling params, ``tools``...).

    Behaviour (OpenAI Responses API semantics, rendered the way vLLM/HF chat templates need it):
    ``instructions`` plus every system/developer message become ONE leading system message (joined
    with a blank line); each model turn (consecutive reasoning, assistant message and function_call
    items) becomes ONE assistant message with ``tool_calls`` ids taken from ``call_id``, reasoning
    rendered per ``options.reasoning_mode`` and the training fields (``prompt_token_ids``,
    ``generation_token_ids``, ``generation_log_probs``) carried over; an item carrying training
    fields ends its model call. ``function_call_output`` becomes a ``tool`` message.

    Raises ``InvalidRequestError`` with ``param`` naming the offending field (e.g.
    ``input[3].call_id``) for malformed input and for features a chat backend cannot honour
    (hosted tools, file/audio inputs, ``previous_response_id``, item references).
    """
    options = options or ConvertOptions()
    if not isinstance(request, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=None)
    if request.get("previous_response_id") is not None:
        raise InvalidRequestError(
            "previous_response_id is not supported: gymserve stores no responses; send the whole "
            "conversation in input", param="previous_response_id")
    if request.get("conversation") is not None:
        raise InvalidRequestError("conversation is not supported; send the whole conversation in input",
                                  param="conversation")
    if request.get("background"):
        raise InvalidRequestError("background is not supported: a background response is stored and polled, and "
                                  "gymserve stores no responses; leave background out (or false)",
                                  param="background")
    _check_include(request.get("include"))

    builder = _MessageBuilder(options)
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError("instructions must be a string", param="instructions")
        if instructions:
            builder.system_texts.append(instructions)

    raw_input = request.get("input")
    if isinstance(raw_input, str):
        builder.add_item({"type": "message", "role": "user", "content": raw_input}, "input")
    elif isinstance(raw_input, list):
        for i, item in enumerate(raw_input):
            builder.add_item(item, f"input[{i}]")
    elif raw_input is not None:
        raise InvalidRequestError("input must be a string or a list of input items", param="input")
    messages = builder.finish()
    if builder.last_tokens is not None:
        # Only the last token record is spliced; check it element by element (see get_token_info).
        info, where = builder.last_tokens
        try:
            get_token_info(dict(info))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{where}: {e.message}", param=f"{where}.{e.param}") from None
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequestError("input is required: give at least one message", param="input")

    chat: ChatRequest = {}
    if "model" in request:
        if not isinstance(request["model"], str):
            raise InvalidRequestError("model must be a string", param="model")
        chat["model"] = request["model"]
    chat["messages"] = messages
    _copy_sampling(request, chat, options)
    if request.get("tools") is not None:
        chat["tools"] = _convert_tools(request["tools"])
    if request.get("tool_choice") is not None:
        chat["tool_choice"] = _convert_tool_choice(request["tool_choice"])
    response_format = _convert_text_format(request.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


class _MessageBuilder:
    """Walks input items in order, merging each model turn into one assistant message."""

    def __init__(self, options: ConvertOptions):
        self.options = options
        self.system_texts: list[str] = []
        self.messages: list[dict[str, Any]] = []
        self._turn: dict[str, Any] | None = None
        self.last_tokens: tuple[Any, str] | None = None  # the last token record and where it was

    def add_item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            self._add_message(item, where)
        elif kind == "reasoning":
            self._add_reasoning(item, where)
        elif kind == "function_call":
            self._add_function_call(item, where)
        elif kind == "function_call_output":
            self._add_function_call_output(item, where)
        elif kind == "item_reference":
            raise InvalidRequestError(f"{where}: item_reference is not supported: gymserve stores no "
                                      "responses; send the full item", param=f"{where}.type")
        elif kind is None:
            raise InvalidRequestError(f"{where} has no type (and no role)", param=f"{where}.type")
        else:
            raise InvalidRequestError(
                f"{where}: item type {kind!r} is not supported by chat backends; supported: message, "
                "reasoning, function_call, function_call_output", param=f"{where}.type")

    def finish(self) -> list[dict[str, Any]]:
        self._flush()
        if self.system_texts:
            return [{"role": "system", "content": "\n\n".join(self.system_texts)}, *self.messages]
        return self.messages

    # -- items -------------------------------------------------------------------------------

    def _add_message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        content = item.get("content")
        if role == "assistant":
            # The OpenAI API accepts output_text parts without id/annotations; so do we.
            text = "" if content is None else _plain_text(content, f"{where}.content")
            turn = self._open_turn()
            if text:
                turn["texts"].append(text)
            self._take_tokens(item, where)
        elif role in ("system", "developer"):
            text = _plain_text(content, f"{where}.content")
            if role == "developer" and self.options.developer_role == "keep":
                self._flush()
                self.messages.append({"role": "developer", "content": text})
            elif text:
                # Templates want exactly one leading system message; hoisting keeps every word.
                self.system_texts.append(text)
        elif role == "user":
            self._flush()
            self.messages.append({"role": "user", "content": _user_content(content, f"{where}.content")})
        else:
            raise InvalidRequestError(
                f"{where}.role must be one of user, assistant, system, developer (got {role!r})",
                param=f"{where}.role")

    def _add_reasoning(self, item: dict[str, Any], where: str) -> None:
        text = _reasoning_text(item, where)
        turn = self._open_turn()
        if text:
            turn["reasoning"].append(text)
        self._take_tokens(item, where)

    def _add_function_call(self, item: dict[str, Any], where: str) -> None:
        call_id, name = _required_str(item, "call_id", where), _required_str(item, "name", where)
        arguments = item.get("arguments")
        if isinstance(arguments, (dict, list)):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            raise InvalidRequestError(f"{where}.arguments must be a JSON string", param=f"{where}.arguments")
        turn = self._open_turn()
        turn["tool_calls"].append({"id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": arguments}})
        self._take_tokens(item, where)

    def _add_function_call_output(self, item: dict[str, Any], where: str) -> None:
        call_id = _required_str(item, "call_id", where)
        output = item.get("output")
        if isinstance(output, str):
            content: Any = output
        elif isinstance(output, list):
            content = _user_content(output, f"{where}.output")
        else:
            raise InvalidRequestError(f"{where}.output must be a string or a list of content parts",
                                      param=f"{where}.output")
        self._flush()
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})

    # -- turns -------------------------------------------------------------------------------

    def _open_turn(self) -> dict[str, Any]:
        if self._turn is None:
            self._turn = {"texts": [], "reasoning": [], "tool_calls": [], "tokens": None}
        return self._turn

    def _take_tokens(self, item: dict[str, Any], where: str) -> None:
        try:
            info = get_token_info(item, deep=False)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{where}: {e.message}", param=f"{where}.{e.param}") from None
        if info is not None:
            self.last_tokens = (info, where)
            self._open_turn()["tokens"] = info
            # Training fields sit on the last item of a model call: whatever follows is a new call,
            # and must stay a separate assistant message so each carries its own token record.
            self._flush()

    def _flush(self) -> None:
        turn, self._turn = self._turn, None
        if turn is None:
            return
        content = "\n\n".join(turn["texts"]) or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reasoning = "\n\n".join(turn["reasoning"])
        mode = self.options.reasoning_mode
        if reasoning and mode == "think_tags":
            message["content"] = f"<think>\n{reasoning}\n</think>\n\n" + (content or "")
        elif reasoning and mode in ("reasoning_content", "reasoning"):
            message[mode] = reasoning
        if turn["tool_calls"]:
            message["tool_calls"] = turn["tool_calls"]
        if turn["tokens"] is not None:
            message.update(turn["tokens"])
        self.messages.append(message)


# -- content helpers -------------------------------------------------------------------------

def _required_str(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}.{key} is required (a non-empty string)", param=f"{where}.{key}")
    return value


def _parts(content: Any, path: str) -> list[dict[str, Any]]:
    """``content`` checked as a list of part objects; ``path`` names it in errors."""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{path} must be a string or a list of content parts", param=path)
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise InvalidRequestError(f"{path}[{j}] must be an object", param=f"{path}[{j}]")
    return content


def _part_text(part: dict[str, Any], where: str) -> str | None:
    """Text of a text-like part; None when the part is not text-like."""
    kind = part.get("type")
    if kind in _TEXT_PART_TYPES:
        key = "text"
    elif kind == "refusal":
        key = "refusal"
    else:
        return None
    value = part.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _unsupported_part(part: dict[str, Any], where: str) -> InvalidRequestError:
    kind = part.get("type")
    if kind in ("input_file", "input_audio", "input_video"):
        return InvalidRequestError(f"{where}: content part type '{kind}' is not supported by chat "
                                   "backends; send text or input_image", param=f"{where}.type")
    return InvalidRequestError(f"{where}: unknown content part type {kind!r}", param=f"{where}.type")


def _plain_text(content: Any, path: str) -> str:
    """System/developer/assistant content: text only (templates take no images there)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(_parts(content, path)):
        text = _part_text(part, f"{path}[{j}]")
        if text is None:
            raise _unsupported_part(part, f"{path}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def _user_content(content: Any, path: str) -> Any:
    """A string, or chat content parts when images are present.

    All-text parts collapse to one string joined with newlines, as vLLM's "string" content format
    does, because many HF chat templates cannot render a list of parts.
    """
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(_parts(content, path)):
        at = f"{path}[{j}]"
        text = _part_text(part, at)
        if text is not None:
            parts.append({"type": "text", "text": text})
        elif part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise InvalidRequestError(f"{at}.image_url is required (a URL or data URL; file_id is "
                                          "not supported)", param=f"{at}.image_url")
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise _unsupported_part(part, at)
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """reasoning_text content if any, else the summaries; "" for encrypted-only items."""
    for key in ("content", "summary"):
        value = item.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            raise InvalidRequestError(f"{where}.{key} must be a list", param=f"{where}.{key}")
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.{key}[{j}].text must be a string",
                                          param=f"{where}.{key}[{j}].text")
            texts.append(part["text"])
        if texts:
            return "\n\n".join(texts)
    return ""


# -- request fields --------------------------------------------------------------------------

def _check(request: dict[str, Any], key: str, types: tuple[type, ...], what: str) -> Any:
    value = request.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise InvalidRequestError(f"{key} must be {what}", param=key)
    return value


# Include values that ask for nothing gymserve could add: results of hosted tools (rejected on
# their own) and encrypted reasoning (it has none to give). Token log-probs have a better home.
_INCLUDE_NOTHING = {"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                    "message.input_image.image_url", "computer_call_output.output.image_url",
                    "code_interpreter_call.outputs", "reasoning.encrypted_content"}


def _check_include(include: Any) -> None:
    """``include`` (OpenAI Responses API values): a list of strings; values that would add nothing
    here are accepted, ``message.output_text.logprobs`` and unknown values are a 400."""
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise InvalidRequestError("include must be a list of strings", param="include")
    for i, value in enumerate(include):
        if value == "message.output_text.logprobs":
            raise InvalidRequestError(
                "include message.output_text.logprobs is not supported; per-token log-probs come as "
                "generation_log_probs on the last output item (local engine; chat backends with "
                "return_token_id_information), or use /v1/chat/completions with logprobs", param=f"include[{i}]")
        if value not in _INCLUDE_NOTHING:
            raise InvalidRequestError(f"include[{i}] {value!r} is not a known include value", param=f"include[{i}]")


_NUMBER = (int, float)
# Responses fields that mean the same in Chat Completions: (name, accepted types, what to say).
_CARRIED = (
    ("temperature", _NUMBER, "a number"), ("top_p", _NUMBER, "a number"),
    ("presence_penalty", _NUMBER, "a number"), ("frequency_penalty", _NUMBER, "a number"),
    ("seed", (int,), "an integer"), ("user", (str,), "a string"), ("metadata", (dict,), "an object"),
    ("stop", (str, list), "a string or a list of strings"), ("parallel_tool_calls", (bool,), "a boolean"),
    ("chat_template_kwargs", (dict,), "an object"),  # engine extra (vLLM, SGLang), e.g. enable_thinking
)


def _copy_sampling(request: dict[str, Any], chat: ChatRequest, options: ConvertOptions) -> None:
    for key, types, what in _CARRIED:
        if _check(request, key, types, what) is not None:
            chat[key] = request[key]
    if _check(request, "max_output_tokens", (int,), "a positive integer") is not None:
        if request["max_output_tokens"] < 1:
            raise InvalidRequestError("max_output_tokens must be a positive integer", param="max_output_tokens")
        chat[options.max_tokens_field] = request["max_output_tokens"]
    if _check(request, "top_logprobs", (int,), "an integer") is not None:
        chat["logprobs"] = True
        chat["top_logprobs"] = request["top_logprobs"]
    if _check(request, "stream", (bool,), "a boolean"):
        chat["stream"] = True
        # The Responses stream must end with usage; chat servers send it only when asked.
        chat["stream_options"] = {"include_usage": True}
    reasoning = _check(request, "reasoning", (dict,), "an object")
    if reasoning and reasoning.get("effort") is not None:
        if not isinstance(reasoning["effort"], str):
            raise InvalidRequestError("reasoning.effort must be a string", param="reasoning.effort")
        chat["reasoning_effort"] = reasoning["effort"]


def _convert_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError(f"{where}: tool type {kind!r} is not supported; {_HOSTED_TOOL_HINT}",
                                      param=f"{where}.type")
        function: dict[str, Any] = {"name": _required_str(tool, "name", where)}
        for key, types in (("description", (str,)), ("parameters", (dict,)), ("strict", (bool,))):
            value = tool.get(key)
            if value is None:
                continue
            if not isinstance(value, types):
                raise InvalidRequestError(f"{where}.{key} has the wrong type", param=f"{where}.{key}")
            function[key] = value
        out.append({"type": "function", "function": function})
    return out


def _convert_tool_choice(choice: Any) -> Any:
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
        '{"type": "function", "name": ...}', param="tool_choice")


def _convert_text_format(text: Any) -> dict[str, Any] | None:
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
    raise InvalidRequestError(f"text.format.type {kind!r} is not supported; use text, json_object or json_schema",
                              param="text.format.type")

