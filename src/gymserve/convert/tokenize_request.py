"""Checks of ``POST /tokenize`` and ``POST /detokenize`` requests, in vLLM's shapes (pure).

vLLM's ``TokenizeRequest`` has two forms (``vllm/entrypoints/serve/tokenize/protocol.py``):

- prompt form (``TokenizeCompletionRequest``): ``prompt`` (a string), ``add_special_tokens``
  (default true), ``return_token_strs``;
- chat form (``TokenizeChatRequest``): ``messages``, ``add_generation_prompt`` (default true),
  ``continue_final_message`` (default false; not together with ``add_generation_prompt``),
  ``add_special_tokens`` (default false: the template writes them), ``tools``,
  ``chat_template_kwargs``, ``return_token_strs``; plus NeMo RL's ``required_prefix_token_ids``.

``DetokenizeRequest``: ``tokens`` (a list of IDs). Both take an optional ``model``. A request with
both ``prompt`` and ``messages``, or neither, is refused; so is a field of neither form (vLLM
ignores unknown fields; here a misspelt ``add_generation_promt`` must not silently change the IDs).
"""

from __future__ import annotations

from typing import Any

from gymserve.convert.request_checks import chat_tools, json_type, without_nulls
from gymserve.errors import InvalidRequestError

PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "return_token_strs",
        "tools",
        "chat_template",
        "chat_template_kwargs",
        "required_prefix_token_ids",
    }
)
_BOOLS = ("add_special_tokens", "return_token_strs", "add_generation_prompt", "continue_final_message")


def check_tokenize_request(request: Any) -> dict[str, Any]:
    """The request without its top-level nulls, checked as one of vLLM's two forms; ``messages`` are
    checked further where they are rendered. Raises ``InvalidRequestError`` (400, ``param`` naming
    the field)."""
    request = _object(request)
    chat = "messages" in request
    if chat == ("prompt" in request):
        raise InvalidRequestError(
            "give prompt (a string: the prompt form) or messages (a list of chat messages: the chat form), "
            "not " + ("both" if chat else "neither"),
            param="messages" if chat else "prompt",
        )
    allowed = CHAT_FIELDS if chat else PROMPT_FIELDS
    for key in request:
        if key not in allowed:
            other = " (a field of the other form)" if key in CHAT_FIELDS | PROMPT_FIELDS else ""
            form = "chat (messages)" if chat else "prompt"
            raise InvalidRequestError(
                f"{key} is not a field of the {form} form of /tokenize{other}; the fields are "
                f"{', '.join(sorted(allowed))}",
                param=key,
                code="unsupported_parameter",
            )
    for key in _BOOLS:
        if key in request and not isinstance(request[key], bool):
            raise InvalidRequestError(f"{key} must be true or false, got {json_type(request[key])}", param=key)
    if chat:
        messages = request["messages"]
        if not isinstance(messages, list) or not messages:
            got = "an empty array" if messages == [] else json_type(messages)
            raise InvalidRequestError(
                f"messages must be a non-empty list of chat messages, got {got}", param="messages"
            )
        chat_tools(request.get("tools"), functions_only=False)
        kwargs = request.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidRequestError(
                f"chat_template_kwargs must be an object, got {json_type(kwargs)}", param="chat_template_kwargs"
            )
    elif not isinstance(request["prompt"], str):
        raise InvalidRequestError(
            f"prompt must be a string, got {json_type(request['prompt'])} (token IDs are already tokens: "
            "POST /detokenize turns them into text)",
            param="prompt",
        )
    return request


def check_detokenize_request(request: Any) -> dict[str, Any]:
    """``{"model"?, "tokens": [int, ...]}`` checked for shape (IDs against a vocabulary: by the
    backend). Raises ``InvalidRequestError`` naming the field."""
    request = _object(request)
    for key in request:
        if key not in ("model", "tokens"):
            raise InvalidRequestError(
                f"{key} is not a field of /detokenize; the fields are model and tokens",
                param=key,
                code="unsupported_parameter",
            )
    if "tokens" not in request:
        raise InvalidRequestError("tokens is required: a list of token IDs", param="tokens")
    if not isinstance(request["tokens"], list):
        raise InvalidRequestError(
            f"tokens must be a list of token IDs, got {json_type(request['tokens'])}", param="tokens"
        )
    return request


def _object(request: Any) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {json_type(request)}")
    request = without_nulls(request)
    if "model" in request and not isinstance(request["model"], str):
        raise InvalidRequestError(f"model must be a string, got {json_type(request['model'])}", param="model")
    return request
