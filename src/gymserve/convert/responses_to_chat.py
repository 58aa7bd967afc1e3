"""Responses create request → Chat Completions create request (pure, no I/O)."""

from __future__ import annotations

import json
from typing import Any

from gymserve.convert.assistant_turn import assistant_message, new_turn, token_info_at
from gymserve.convert.field_paths import FieldPaths
from gymserve.convert.input_content import plain_text, reasoning_text, user_content
from gymserve.convert.options import ConvertOptions
from gymserve.convert.request_checks import json_type, required_str, without_nulls
from gymserve.convert.responses_fields import (
    check_include,
    convert_text_format,
    convert_tool_choice,
    convert_tools,
    copy_sampling,
)
from gymserve.errors import InvalidRequestError
from gymserve.protocol import ChatRequest, ResponsesRequest
from gymserve.wire.reasoning import REASONING_FIELDS


def responses_to_chat(
    request: ResponsesRequest, options: ConvertOptions | None = None, paths: FieldPaths | None = None
) -> ChatRequest:
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

    A top-level ``null`` means the field is absent. A conversation of system/developer messages
    only (or ``instructions`` with an empty ``input`` list) is one system message: the model
    answers it. Fields of the Chat Completions API (``max_tokens``...) are refused before this, by
    ``request_checks.check_request`` (the server runs it for every backend).

    Raises ``InvalidRequestError`` with ``param`` naming the offending field (e.g.
    ``input[3].call_id``) for malformed input and for features a chat backend cannot honour
    (hosted tools, file/audio inputs, ``previous_response_id``, item references).

    ``paths``: filled with where each chat message came from (``field_paths.FieldPaths``), so an
    error a later step raises about the chat request can be told in Responses fields.
    """
    options = options or ConvertOptions()
    if not isinstance(request, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {json_type(request)}", param=None)
    request = without_nulls(request)
    if request.get("previous_response_id") is not None:
        raise InvalidRequestError(
            "previous_response_id is not supported: gymserve stores no responses; send the whole conversation in input",
            param="previous_response_id",
        )
    if request.get("conversation") is not None:
        raise InvalidRequestError(
            "conversation is not supported; send the whole conversation in input", param="conversation"
        )
    if request.get("background"):
        raise InvalidRequestError(
            "background is not supported: a background response is stored and polled, and "
            "gymserve stores no responses; leave background out (or false)",
            param="background",
        )
    check_include(request.get("include"))

    builder = _MessageBuilder(options, paths if paths is not None else FieldPaths())
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError(
                f"instructions must be a string, got {json_type(instructions)}", param="instructions"
            )
        if instructions:
            builder.add_system(instructions, "instructions")

    raw_input = request.get("input")
    if isinstance(raw_input, str):
        builder.add_item({"type": "message", "role": "user", "content": raw_input}, "input")
    elif isinstance(raw_input, list):
        for i, item in enumerate(raw_input):
            builder.add_item(item, f"input[{i}]")
    elif raw_input is None:
        raise InvalidRequestError(
            "input is required: a string, or a list of input items (gymserve stores no conversations to continue)",
            param="input",
        )
    else:
        raise InvalidRequestError(
            f"input must be a string or a list of input items, got {json_type(raw_input)}", param="input"
        )
    messages = builder.finish()
    if builder.last_tokens is not None:
        # Only the last token record is spliced; check it element by element (see get_token_info).
        info, where = builder.last_tokens
        token_info_at(dict(info), where)
    if not messages:
        what = "is empty" if raw_input == [] else "holds no message text"
        raise InvalidRequestError(f"input {what}: give a string or at least one message item", param="input")

    chat: ChatRequest = {}
    if "model" in request:
        if not isinstance(request["model"], str):
            raise InvalidRequestError(f"model must be a string, got {json_type(request['model'])}", param="model")
        chat["model"] = request["model"]
    chat["messages"] = messages
    copy_sampling(request, chat, options)
    if request.get("tools") is not None:
        chat["tools"] = convert_tools(request["tools"])
    if request.get("tool_choice") is not None:
        chat["tool_choice"] = convert_tool_choice(request["tool_choice"])
    response_format = convert_text_format(request.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


class _MessageBuilder:
    """Walks input items in order, merging each model turn into one assistant message."""

    def __init__(self, options: ConvertOptions, paths: FieldPaths):
        self.options = options
        self.paths = paths
        self.system_texts: list[str] = []
        self.system_origin = ""
        self.messages: list[dict[str, Any]] = []
        self._turn: dict[str, Any] | None = None
        self.last_tokens: tuple[Any, str] | None = None  # the last token record and where it was

    def add_item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an input item object, got {json_type(item)}", param=where)
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
            raise InvalidRequestError(
                f"{where}: item_reference is not supported: gymserve stores no responses; send the full item",
                param=f"{where}.type",
            )
        elif kind is None:
            raise InvalidRequestError(f"{where} has no type (and no role)", param=f"{where}.type")
        else:
            raise InvalidRequestError(
                f"{where}: item type {kind!r} is not supported by chat backends; supported: message, "
                "reasoning, function_call, function_call_output",
                param=f"{where}.type",
            )

    def add_system(self, text: str, where: str) -> None:
        self.system_texts.append(text)
        self.system_origin = self.system_origin or where

    def _append(self, message: dict[str, Any], origin: dict[str, str]) -> None:
        self.messages.append(message)
        self.paths.origins.append(origin)

    def finish(self) -> list[dict[str, Any]]:
        self._flush()
        if self.system_texts:
            origin = self.system_origin
            self.paths.origins.insert(
                0, {"": origin, "content": origin if origin == "instructions" else f"{origin}.content"}
            )
            return [{"role": "system", "content": "\n\n".join(self.system_texts)}, *self.messages]
        return self.messages

    # -- items -------------------------------------------------------------------------------

    def _add_message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        content = item.get("content")
        if role == "assistant":
            # The OpenAI API accepts output_text parts without id/annotations; so do we.
            text = "" if content is None else plain_text(content, f"{where}.content")
            turn = self._open_turn(where)
            if text:
                turn["texts"].append(text)
                turn["origin"].setdefault("content", f"{where}.content")
            self._take_tokens(item, where)
        elif role in ("system", "developer"):
            text = plain_text(content, f"{where}.content")
            if role == "developer" and self.options.developer_role == "keep":
                self._flush()
                self._append({"role": "developer", "content": text}, _item_origin(where))
            elif text:
                # Templates want exactly one leading system message; hoisting keeps every word.
                self.add_system(text, where)
        elif role == "user":
            self._flush()
            self._append({"role": "user", "content": user_content(content, f"{where}.content")}, _item_origin(where))
        else:
            problem = "is required" if role is None else f"{role!r} is not a role"
            raise InvalidRequestError(
                f"{where}.role {problem}: use user, assistant, system or developer", param=f"{where}.role"
            )

    def _add_reasoning(self, item: dict[str, Any], where: str) -> None:
        text = reasoning_text(item, where)
        turn = self._open_turn(where)
        if text:
            turn["reasoning"].append(text)
            for key in REASONING_FIELDS:
                turn["origin"].setdefault(key, where)
        self._take_tokens(item, where)

    def _add_function_call(self, item: dict[str, Any], where: str) -> None:
        call_id, name = required_str(item, "call_id", where), required_str(item, "name", where)
        arguments = item.get("arguments")
        if isinstance(arguments, (dict, list)):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            raise InvalidRequestError(
                f"{where}.arguments must be a JSON string, got {json_type(arguments)}", param=f"{where}.arguments"
            )
        turn = self._open_turn(where)
        turn["origin"][f"tool_calls[{len(turn['tool_calls'])}]"] = where
        turn["tool_calls"].append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
        self._take_tokens(item, where)

    def _add_function_call_output(self, item: dict[str, Any], where: str) -> None:
        call_id = required_str(item, "call_id", where)
        output = item.get("output")
        if isinstance(output, str):
            content: Any = output
        elif isinstance(output, list):
            content = user_content(output, f"{where}.output")
        else:
            raise InvalidRequestError(
                f"{where}.output must be a string or a list of content parts, got {json_type(output)}",
                param=f"{where}.output",
            )
        self._flush()
        origin = {"": where, "tool_call_id": f"{where}.call_id", "content": f"{where}.output"}
        self._append({"role": "tool", "tool_call_id": call_id, "content": content}, origin)

    # -- turns -------------------------------------------------------------------------------

    def _open_turn(self, where: str) -> dict[str, Any]:
        if self._turn is None:
            self._turn = {**new_turn(), "origin": {"": where}}
        return self._turn

    def _take_tokens(self, item: dict[str, Any], where: str) -> None:
        info = token_info_at(item, where, deep=False)
        if info is not None:
            self.last_tokens = (info, where)
            turn = self._open_turn(where)
            turn["tokens"] = info
            turn["origin"].update({field: f"{where}.{field}" for field in info})
            # Training fields sit on the last item of a model call: whatever follows is a new call,
            # and must stay a separate assistant message so each carries its own token record.
            self._flush()

    def _flush(self) -> None:
        turn, self._turn = self._turn, None
        if turn is not None:
            self._append(assistant_message(turn, self.options), turn["origin"])


# -- content helpers -------------------------------------------------------------------------


def _item_origin(where: str) -> dict[str, str]:
    """The origin of a message built from one message item (``field_paths.FieldPaths``)."""
    return {"": where, "content": f"{where}.content", "role": f"{where}.role"}
