"""Anthropic Messages create request → Chat Completions create request (pure, no I/O).

The Messages API is Anthropic's ``POST /v1/messages`` (API reference "Create a Message",
``anthropic-version: 2023-06-01``; the request shape is the anthropic SDK's ``MessageCreateParams``).
Every backend that speaks Chat Completions serves it through this conversion (and
``chat_to_messages`` back), the way ``responses_to_chat`` serves the Responses API.

Rules, and where they come from:

- ``system`` (a string or a list of text blocks) and every ``role: "system"`` message become ONE
  leading system message, blocks joined with a blank line: chat templates want exactly one.
- Consecutive messages of one role are one turn (Anthropic: "Consecutive user or assistant turns in
  your request will be combined into a single turn"); an assistant message that carries training
  fields ends its model call, so the next one starts a new chat assistant message.
- user blocks: ``text`` (joined with newlines, as vLLM's "string" content format does) and
  ``tool_result`` → a ``tool`` message (``tool_call_id`` = ``tool_use_id``; text blocks of its
  ``content`` joined with newlines; ``is_error: true`` prefixes the text with ``"Error: "`` so the
  model still sees that the tool failed — a chat tool message has no error flag).
- assistant blocks: ``text``, ``thinking`` (→ reasoning, rendered per ``ConvertOptions.reasoning_mode``;
  the ``signature`` is not checked), ``redacted_thinking`` (opaque, dropped: there is no text to
  render), ``tool_use`` (→ ``tool_calls`` with ``arguments`` = ``input`` as JSON, ``id`` kept so
  ``tool_result.tool_use_id`` still matches).
- refused with a 400 naming the block: ``image`` and ``document`` blocks (this path is text and
  tools), server-tool blocks (they run on Anthropic's side), a final assistant message (prefill:
  the answer would start a new turn instead of continuing it — Anthropic answers the same 400 on
  models without prefill).
- top level: ``max_tokens`` (required, ≥ 1) → ``max_tokens``; ``stop_sequences`` → ``stop``;
  ``temperature`` (0–1), ``top_p`` (0–1), ``top_k`` (≥ 0) as they are; ``tools`` (client tools:
  ``name``, ``description``, ``input_schema``) → function tools; ``tool_choice`` ``auto`` /
  ``any`` / ``tool`` / ``none`` → ``auto`` / ``required`` / a named function / ``none``
  (``disable_parallel_tool_use`` → ``parallel_tool_calls: false``); ``metadata.user_id`` →
  ``user``; ``output_config.effort`` → ``reasoning_effort`` and ``output_config.format`` →
  ``response_format`` (as vLLM's Messages endpoint does). ``thinking``, ``cache_control``,
  ``service_tier``, ``speed``, ``inference_geo``, ``diagnostics``, ``user_profile_id`` and
  ``workspace_id`` are accepted and change nothing here (hints for Anthropic's own service);
  ``chat_template_kwargs`` is carried as the engine extra vLLM's Messages endpoint also takes, and
  NeMo RL's ``required_prefix_token_ids`` as the chat and Responses routes take it.
  Other fields are ignored, as vLLM's Messages endpoint and gymserve's Responses route do (new
  SDK releases and harness betas add fields faster than a server can list them), except: a Chat
  Completions or Responses field is a 400 naming the Messages field to use, and ``container`` /
  ``mcp_servers`` (features Anthropic runs on its side) are a 400.

Training fields (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``) come back
on an assistant message — beside ``role`` and ``content``, or on one of its content blocks — and go
onto the chat assistant message, where the prefix splice reads them.
"""

from __future__ import annotations

import json
from typing import Any

from gymserve.convert.assistant_turn import assistant_message, new_turn, token_info_at
from gymserve.convert.field_paths import MESSAGES, FieldPaths
from gymserve.convert.messages_fields import (
    check_top_level,
    convert_tool_choice,
    convert_tools,
    copy_sampling,
    of_type,
)
from gymserve.convert.options import ConvertOptions
from gymserve.convert.request_checks import json_type, required_str, without_nulls
from gymserve.errors import InvalidRequestError
from gymserve.protocol import ChatRequest, MessagesRequest, TokenInfo
from gymserve.wire.reasoning import REASONING_FIELDS

_NOT_ON_CHAT = {
    "image": "image blocks are not supported on /v1/messages by gymserve's chat conversion (text and tools only); "
    "send images as image_url parts to /v1/chat/completions on a backend whose model takes them",
    "document": "document blocks are not supported on /v1/messages by gymserve's chat conversion; put the text "
    "in a text block",
    "search_result": "search_result blocks are not supported by gymserve's chat conversion; put the text in a "
    "text block",
    "container_upload": "container_upload blocks belong to Anthropic's code-execution containers, which gymserve "
    "does not run",
}


def messages_to_chat(
    request: MessagesRequest,
    options: ConvertOptions | None = None,
    paths: FieldPaths | None = None,
    *,
    count_only: bool = False,
) -> ChatRequest:
    """Translate a Messages create request into a Chat Completions create request.

    Input: a ``MessageCreateParams``-shaped dict (top-level nulls mean absent). Output: a
    ``CompletionCreateParams``-shaped dict (``model``, ``messages``, ``max_tokens``, sampling
    params, ``tools``, ``tool_choice``...), ``stream`` left to the caller. ``options``: how the
    backend wants history rendered (``reasoning_mode``; ``max_tokens_field``). ``count_only``: the
    request of ``POST /v1/messages/count_tokens``, which has no ``max_tokens`` and no sampling.
    ``paths``: filled with where each chat message came from (a ``field_paths.FieldPaths`` of the
    ``MESSAGES`` vocabulary), so an error about the chat request can name the Messages field.

    Raises ``InvalidRequestError`` (400) with ``param`` naming the field in the caller's words
    (``messages[2].content[0].tool_use_id``) for malformed input and for what this conversion
    refuses (see the module docstring).
    """
    options = options or ConvertOptions()
    if not isinstance(request, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {json_type(request)}")
    request = without_nulls(request)
    check_top_level(request)
    if "model" in request and not isinstance(request["model"], str):
        raise InvalidRequestError(f"model must be a string, got {json_type(request['model'])}", param="model")

    builder = _Builder(options, paths if paths is not None else FieldPaths(MESSAGES))
    builder.add_system(request.get("system"), "system")
    raw = request.get("messages")
    if raw is None:
        raise InvalidRequestError(
            'messages is required: a non-empty list of {"role": "user" | "assistant", "content": ...} messages',
            param="messages",
        )
    if not isinstance(raw, list) or not raw:
        got = "an empty array" if raw == [] else json_type(raw)
        raise InvalidRequestError(f"messages must be a non-empty list of messages, got {got}", param="messages")
    for i, message in enumerate(raw):
        builder.add_message(message, f"messages[{i}]")
    messages = builder.finish()
    if builder.last_tokens is not None:
        # Only the last record is spliced: check it element by element (see get_token_info).
        info, where = builder.last_tokens
        token_info_at(dict(info), where)

    chat: ChatRequest = {"messages": messages}
    if "model" in request:
        chat["model"] = request["model"]
    if request.get("tools") is not None:
        chat["tools"] = convert_tools(request["tools"])
    if request.get("tool_choice") is not None:
        convert_tool_choice(request["tool_choice"], chat)
    kwargs = of_type(request, "chat_template_kwargs", dict, "an object")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    prefix = request.get("required_prefix_token_ids")
    if prefix is not None:  # NeMo RL's, as on the chat and Responses routes; checked where it is used
        chat["required_prefix_token_ids"] = prefix
    if not count_only:
        copy_sampling(request, chat, options)
    return chat


# -- messages -------------------------------------------------------------------------------


class _Builder:
    """Walks the messages in order: one leading system message, one chat message per turn."""

    def __init__(self, options: ConvertOptions, paths: FieldPaths):
        self.options = options
        self.paths = paths
        self.system: list[str] = []
        self.system_origin: dict[str, str] | None = None
        self.messages: list[dict[str, Any]] = []
        self.turn: dict[str, Any] | None = None  # the assistant turn being gathered
        self.user: list[str] | None = None  # the user text being gathered
        self.user_origin: dict[str, str] = {}
        self.last_tokens: tuple[TokenInfo, str] | None = None
        self.last: tuple[str, str] | None = None  # (role, where) of the last user/assistant message

    def add_system(self, system: Any, where: str) -> None:
        if system is None:
            return
        if isinstance(system, str):
            texts = [system]
        elif isinstance(system, list):
            texts = [_text_block(block, f"{where}[{j}]") for j, block in enumerate(system)]
        else:
            raise InvalidRequestError(
                f"{where} must be a string or a list of text blocks, got {json_type(system)}", param=where
            )
        self.system += [t for t in texts if t]
        if self.system and self.system_origin is None:
            self.system_origin = {"": where, "content": where}

    def add_message(self, message: Any, where: str) -> None:
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be a message object, got {json_type(message)}", param=where)
        role = message.get("role")
        content = message.get("content")
        if content is None:
            raise InvalidRequestError(
                f"{where}.content is required: a string or a list of content blocks", param=f"{where}.content"
            )
        if not isinstance(content, (str, list)):
            raise InvalidRequestError(
                f"{where}.content must be a string or a list of content blocks, got {json_type(content)}",
                param=f"{where}.content",
            )
        if role == "system":
            self.add_system(content, f"{where}.content")
            return
        if role == "user":
            self._user(content, where)
        elif role == "assistant":
            self._assistant(message, content, where)
        else:
            problem = "is required" if role is None else f"{role!r} is not a role"
            raise InvalidRequestError(
                f"{where}.role {problem}: use user or assistant (tool results go in tool_result blocks of a user "
                "message; the system prompt in system)",
                param=f"{where}.role",
            )
        self.last = (role, where)

    def finish(self) -> list[dict[str, Any]]:
        if self.last is not None and self.last[0] == "assistant":
            raise InvalidRequestError(
                f"{self.last[1]} is an assistant message at the end (prefill), which gymserve cannot continue: the "
                "model would start a new turn instead of continuing yours. End messages with a user message",
                param=self.last[1],
            )
        self._flush_turn()
        self._flush_user()
        if not self.system:
            return self.messages
        self.paths.origins.insert(0, self.system_origin or {})
        return [{"role": "system", "content": "\n\n".join(self.system)}, *self.messages]

    def _append(self, message: dict[str, Any], origin: dict[str, str]) -> None:
        self.messages.append(message)
        self.paths.origins.append(origin)

    # -- user ----------------------------------------------------------------------------------

    def _user(self, content: str | list[Any], where: str) -> None:
        if content == []:  # it would vanish from the conversation (an assistant's may be empty: an EOS at once)
            raise InvalidRequestError(
                f"{where}.content is an empty list: a user message needs at least one content block (a text or "
                "tool_result block), as Anthropic requires non-empty content",
                param=f"{where}.content",
            )
        self._flush_turn()
        if isinstance(content, str):
            self._user_text(content, where)
            return
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = _block_type(block, at)
            if kind == "text":
                self._user_text(_text_block(block, at), where)
            elif kind == "tool_result":
                self._flush_user()
                origin = {"": at, "tool_call_id": f"{at}.tool_use_id", "content": f"{at}.content"}
                self._append(_tool_result(block, at), origin)
            elif kind in ("tool_use", "thinking", "redacted_thinking"):
                raise InvalidRequestError(
                    f"{at}: a {kind} block belongs in an assistant message, not a user message", param=f"{at}.type"
                )
            else:
                raise _unsupported(kind, at)

    def _user_text(self, text: str, where: str) -> None:
        if self.user is None:
            self.user = []
            self.user_origin = {"": where, "content": f"{where}.content", "role": f"{where}.role"}
        self.user.append(text)

    def _flush_user(self) -> None:
        if self.user is not None:
            self._append({"role": "user", "content": "\n".join(self.user)}, self.user_origin)
            self.user = None

    # -- assistant ---------------------------------------------------------------------------

    def _assistant(self, message: dict[str, Any], content: str | list[Any], where: str) -> None:
        self._flush_user()
        turn = self._open_turn(where)
        tokens = _tokens(message, where)
        if isinstance(content, str):
            if content:
                turn["texts"].append(content)
                turn["origin"].setdefault("content", f"{where}.content")
        else:
            for j, block in enumerate(content):
                at = f"{where}.content[{j}]"
                kind = _block_type(block, at)
                if kind == "text":
                    text = _text_block(block, at)
                    if text:
                        turn["texts"].append(text)
                        turn["origin"].setdefault("content", f"{at}.text")
                elif kind == "thinking":
                    thinking = block.get("thinking")
                    if not isinstance(thinking, str):
                        raise InvalidRequestError(
                            f"{at}.thinking must be a string, got {json_type(thinking)}", param=f"{at}.thinking"
                        )
                    if thinking:
                        turn["reasoning"].append(thinking)
                        for key in REASONING_FIELDS:
                            turn["origin"].setdefault(key, f"{at}.thinking")
                elif kind == "redacted_thinking":
                    pass  # opaque, encrypted by Anthropic: no text a template could render
                elif kind == "tool_use":
                    turn["origin"][f"tool_calls[{len(turn['tool_calls'])}]"] = at
                    turn["tool_calls"].append(_tool_use(block, at))
                elif kind == "tool_result":
                    raise InvalidRequestError(
                        f"{at}: a tool_result block belongs in a user message, after the assistant's tool_use",
                        param=f"{at}.type",
                    )
                else:
                    raise _unsupported(kind, at)
                block_tokens = _tokens(block, at)
                if block_tokens is not None:
                    if tokens is not None:
                        raise InvalidRequestError(
                            f"{at} carries training fields and so does {where}: send them once, on the message",
                            param=f"{at}.prompt_token_ids",
                        )
                    tokens = block_tokens
        if tokens is not None:
            info, at = tokens
            turn["tokens"] = info
            turn["origin"].update({field: f"{at}.{field}" for field in info})
            self.last_tokens = tokens
            # A message with token fields is one model call: whatever follows starts another.
            self._flush_turn()

    def _open_turn(self, where: str) -> dict[str, Any]:
        if self.turn is None:
            self.turn = {**new_turn(), "origin": {"": where}}
        return self.turn

    def _flush_turn(self) -> None:
        turn, self.turn = self.turn, None
        if turn is not None:
            self._append(assistant_message(turn, self.options), turn["origin"])


# -- blocks ---------------------------------------------------------------------------------


def _block_type(block: Any, at: str) -> str:
    if not isinstance(block, dict):
        raise InvalidRequestError(f"{at} must be a content block object, got {json_type(block)}", param=at)
    kind = block.get("type")
    if not isinstance(kind, str) or not kind:
        raise InvalidRequestError(
            f"{at}.type is required (text, tool_use, tool_result, thinking...)", param=f"{at}.type"
        )
    return kind


def _text_block(block: Any, at: str) -> str:
    if _block_type(block, at) != "text":
        raise InvalidRequestError(f"{at} must be a text block, got type {block.get('type')!r}", param=f"{at}.type")
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{at}.text must be a string, got {json_type(text)}", param=f"{at}.text")
    return text


def _unsupported(kind: str, at: str) -> InvalidRequestError:
    why = _NOT_ON_CHAT.get(kind)
    if why is None and (kind.endswith("_tool_result") or kind in ("server_tool_use", "mcp_tool_use")):
        why = f"{kind} blocks come from Anthropic's server tools, which gymserve does not run"
    if why is None:
        why = (
            f"unknown content block type {kind!r}; supported: text, thinking, redacted_thinking, tool_use, tool_result"
        )
    return InvalidRequestError(f"{at}: {why}", param=f"{at}.type")


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, name = required_str(block, "id", at), required_str(block, "name", at)
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise InvalidRequestError(
            f"{at}.input must be an object (the tool's arguments), got {json_type(arguments)}", param=f"{at}.input"
        )
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = required_str(block, "tool_use_id", at)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"{at}.content[{j}]"
            kind = _block_type(part, where)
            if kind != "text":
                raise _unsupported(kind, where)
            texts.append(_text_block(part, where))
        text = "\n".join(texts)
    else:
        raise InvalidRequestError(
            f"{at}.content must be a string or a list of text blocks, got {json_type(content)}",
            param=f"{at}.content",
        )
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequestError(f"{at}.is_error must be a boolean, got {json_type(is_error)}", param=f"{at}.is_error")
    if is_error:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tokens(obj: dict[str, Any], at: str) -> tuple[TokenInfo, str] | None:
    info = token_info_at(obj, at, deep=False)
    return None if info is None else (info, at)
