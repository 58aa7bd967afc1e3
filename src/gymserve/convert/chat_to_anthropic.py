"""Chat Completions ⇄ an Anthropic Messages upstream (pure, no I/O): what the ``anthropic`` backend
needs to serve ``/v1/chat/completions`` (and, through it, ``/v1/responses``) from a Messages API.

- :func:`chat_to_messages_request`: a chat request as the Messages request Anthropic's API takes
  (``POST /v1/messages``, ``anthropic-version: 2023-06-01``): system and developer messages → ``system``;
  assistant ``tool_calls`` → ``tool_use`` blocks (``input`` = the parsed arguments); ``tool``
  messages → ``tool_result`` blocks of the next user message; ``image_url`` parts → ``image`` blocks
  (a data URL as ``base64``, else ``url``); ``max_tokens`` (required there: ``default_max_tokens``
  when the request gives none), ``stop`` → ``stop_sequences``, ``tool_choice`` ``required`` →
  ``any``, ``parallel_tool_calls: false`` → ``disable_parallel_tool_use``, ``user`` →
  ``metadata.user_id``, ``reasoning_effort`` / ``response_format`` → ``output_config``. Reasoning in
  the history is left out: Anthropic checks the signature of every thinking block sent back, and
  a chat history has none. Engine extras (``chat_template_kwargs``) and OpenAI's stored-completion
  ``metadata`` mean nothing there and are left out; what would change the answer and cannot be
  honoured (``n`` > 1, ``logprobs``, penalties, ``logit_bias``, ``seed``) is a 400.
- :func:`message_to_chat_completion`: a ``Message`` as a ``ChatCompletion`` (text joined; thinking →
  ``reasoning_content`` and ``reasoning``; ``tool_use`` → ``tool_calls``; stop reasons → finish
  reasons; usage with cache reads as ``cached_tokens``).
- :class:`ChunksFromEvents`: Messages streaming events → ``ChatCompletionChunk`` dicts.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gymserve.convert.request_checks import json_type
from gymserve.errors import InvalidRequestError
from gymserve.protocol import ChatCompletionDict, ChatRequest, MessageDict, MessagesRequest
from gymserve.wire.ids import new_id
from gymserve.wire.reasoning import REASONING_FIELDS

# Stop reason → chat finish_reason.
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}
_NOT_HONOURED = {
    "logprobs": "an Anthropic upstream returns no log-probs",
    "top_logprobs": "an Anthropic upstream returns no log-probs",
    "logit_bias": "the Messages API has no logit_bias",
    "seed": "the Messages API has no seed",
    "presence_penalty": "the Messages API has no penalties",
    "frequency_penalty": "the Messages API has no penalties",
}


def chat_to_messages_request(request: ChatRequest, *, default_max_tokens: int) -> MessagesRequest:
    """The Messages request for a chat request (module docstring); ``stream`` is left to the
    caller. Raises ``InvalidRequestError`` naming the chat field for what the upstream cannot do."""
    if request.get("n") not in (None, 1):
        raise InvalidRequestError("n > 1 is not supported by the Messages API; send several requests", param="n")
    for key, why in _NOT_HONOURED.items():
        if request.get(key) not in (None, False, 0):
            raise InvalidRequestError(f"{key} cannot be honoured by an anthropic backend: {why}; omit it", param=key)
    system, messages = _conversation(request.get("messages") or [])
    body: MessagesRequest = {"messages": messages}
    if request.get("model"):
        body["model"] = request["model"]
    if system:
        body["system"] = system
    limit = request.get("max_completion_tokens") or request.get("max_tokens")
    body["max_tokens"] = limit if isinstance(limit, int) and not isinstance(limit, bool) else default_max_tokens
    for key in ("temperature", "top_p", "top_k"):
        if request.get(key) is not None:
            body[key] = request[key]
    stop = request.get("stop")
    if stop:
        body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if request.get("tools"):
        body["tools"] = [_tool(tool) for tool in request["tools"]]
    choice = _tool_choice(request.get("tool_choice"), request.get("parallel_tool_calls"))
    if choice is not None:
        body["tool_choice"] = choice
    if isinstance(request.get("user"), str) and request["user"]:
        body["metadata"] = {"user_id": request["user"]}
    config: dict[str, Any] = {}
    if isinstance(request.get("reasoning_effort"), str):
        config["effort"] = request["reasoning_effort"]
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        config["format"] = {"type": "json_schema", "schema": (fmt.get("json_schema") or {}).get("schema") or {}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        raise InvalidRequestError(
            "response_format json_object has no Messages API counterpart; use json_schema", param="response_format"
        )
    if config:
        body["output_config"] = config
    return body


def _conversation(messages: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    system: list[str] = []
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        # Consecutive turns of one role are one turn (Anthropic merges them; tool results must
        # reach the user turn right after the assistant's tool_use).
        if out and out[-1]["role"] == role:
            out[-1]["content"] += blocks
        elif blocks:
            out.append({"role": role, "content": blocks})

    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            system.append(_text(message.get("content"), where))
        elif role == "user":
            add("user", _user_blocks(message.get("content"), where))
        elif role == "tool":
            result = {
                "type": "tool_result",
                "tool_use_id": message.get("tool_call_id") or "",
                "content": _text(message.get("content"), where),
            }
            add("user", [result])
        elif role == "assistant":
            blocks: list[dict[str, Any]] = []
            text = _text(message.get("content"), where) if message.get("content") is not None else ""
            if text:
                blocks.append({"type": "text", "text": text})
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                except ValueError:
                    arguments = {}
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id") or new_id("call"),
                        "name": function.get("name") or "",
                        "input": arguments if isinstance(arguments, dict) else {},
                    }
                )
            add("assistant", blocks)
        else:
            raise InvalidRequestError(f"{where}.role {role!r} is not a chat role", param=f"{where}.role")
    return "\n\n".join(t for t in system if t), out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is None:
        return ""
    raise InvalidRequestError(f"{where}.content must be a string or a list of parts, got {json_type(content)}")


def _user_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            blocks.append({"type": "text", "text": part.get("text") or ""})
        elif kind == "image_url":
            url = (part.get("image_url") or {}).get("url") or ""
            if url.startswith("data:") and ";base64," in url:
                media, _, data = url[5:].partition(";base64,")
                blocks.append({"type": "image", "source": {"type": "base64", "media_type": media, "data": data}})
            else:
                blocks.append({"type": "image", "source": {"type": "url", "url": url}})
        else:
            raise InvalidRequestError(
                f"{where}.content[{j}]: part type {kind!r} has no Messages API counterpart; send text or image_url",
                param=f"{where}.content[{j}].type",
            )
    return blocks


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") or {}
    out = {"name": function.get("name") or "", "input_schema": function.get("parameters") or {"type": "object"}}
    if function.get("description"):
        out["description"] = function["description"]
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    if isinstance(choice, dict):
        out: dict[str, Any] = {"type": "tool", "name": (choice.get("function") or {}).get("name") or ""}
    elif choice in ("auto", "none"):
        out = {"type": choice}
    elif choice == "required":
        out = {"type": "any"}
    elif parallel is False:
        out = {"type": "auto"}
    else:
        return None
    if parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


# -- answers --------------------------------------------------------------------------------


def _chat_usage(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    cached = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0) + cached
    completion = int(usage.get("output_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def message_to_chat_completion(message: MessageDict) -> ChatCompletionDict:
    """A ``Message`` as a ``ChatCompletion`` (module docstring); the stop sequence that ended it, if
    any, in ``choices[0].stop_reason`` as vLLM reports it."""
    texts, thinking, calls = [], [], []
    for block in message.get("content") or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "thinking":
            thinking.append(block.get("thinking") or "")
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or new_id("call"),
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                    },
                }
            )
    chat_message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thinking:
        for field in REASONING_FIELDS:
            chat_message[field] = "\n\n".join(thinking)
    if calls:
        chat_message["tool_calls"] = calls
    choice = {
        "index": 0,
        "finish_reason": FINISH_REASONS.get(message.get("stop_reason") or "end_turn", "stop"),
        "logprobs": None,
        "message": chat_message,
    }
    if message.get("stop_sequence"):
        choice["stop_reason"] = message["stop_sequence"]
    return {
        "id": message.get("id") or new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": message.get("model") or "",
        "choices": [choice],
        "usage": _chat_usage(message.get("usage")),
    }


class ChunksFromEvents:
    """Messages streaming events → ``ChatCompletionChunk`` dicts: ``feed(event)`` returns the chunks
    one event makes (a role chunk for ``message_start``; content, reasoning and tool-call deltas;
    the finish chunk for ``message_delta``, then a usage chunk when ``include_usage``)."""

    def __init__(self, *, include_usage: bool = False):
        self.include_usage = include_usage
        self._head: dict[str, Any] = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "model": ""}
        self._head["created"] = int(time.time())
        self._calls: dict[int, int] = {}  # content block index -> tool call index
        self._usage: dict[str, Any] = {}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return {**self._head, "choices": [choice]}

    def feed(self, event: Any) -> list[dict[str, Any]]:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "message_start":
            message = event.get("message") or {}
            self._head["model"] = message.get("model") or ""
            self._usage = dict(message.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self._calls[event.get("index", 0)] = len(self._calls)
                call = {"index": index, "id": block.get("id"), "type": "function"}
                call["function"] = {"name": block.get("name") or "", "arguments": ""}
                return [self._chunk({"tool_calls": [call]})]
            return []
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                return [self._chunk({"content": delta["text"]})]
            if delta.get("type") == "thinking_delta" and delta.get("thinking"):
                return [self._chunk(dict.fromkeys(REASONING_FIELDS, delta["thinking"]))]
            if delta.get("type") == "input_json_delta" and event.get("index") in self._calls:
                call = {
                    "index": self._calls[event["index"]],
                    "function": {"arguments": delta.get("partial_json") or ""},
                }
                return [self._chunk({"tool_calls": [call]})]
            return []
        if kind == "message_delta":
            stop = (event.get("delta") or {}).get("stop_reason") or "end_turn"
            self._usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
            sequence = (event.get("delta") or {}).get("stop_sequence")
            chunks = [
                self._chunk({}, FINISH_REASONS.get(stop, "stop"), **({"stop_reason": sequence} if sequence else {}))
            ]
            if self.include_usage:
                chunks.append({**self._head, "choices": [], "usage": _chat_usage(self._usage)})
            return chunks
        return []
