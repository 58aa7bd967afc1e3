"""Checks of a ``POST /v1/completions`` request (the legacy Completions API, for base models; pure).

The shape is the OpenAI API's ``CompletionCreateParams`` (``openai.types.CompletionCreateParams``)
with vLLM's extras (``return_tokens_as_token_ids``, ``add_special_tokens``, ``top_k``...). Rules and
their sources:

- ``prompt`` is required: a string, a list of strings, a list of token IDs, or a list of such lists
  (the OpenAI API's four forms, which vLLM accepts too); each prompt of a list is answered by ``n``
  choices, choice ``i * n + j`` for prompt ``i`` (vLLM's numbering). An empty prompt is refused.
- ``max_tokens`` defaults to 16, as in the OpenAI API and vLLM; ``logprobs`` is an integer from 0
  to 20 (the OpenAI API allows 5, vLLM ``--max-logprobs`` 20 by default), vLLM's
  ``prompt_logprobs`` too; ``n`` from 1 to 128.
- ``suffix`` (insert mode) is refused: neither vLLM nor the open models served here implement it.
  ``best_of`` other than ``n`` is refused, as vLLM's V1 engine does (sample ``n`` and rank them yourself).
- Fields of the other APIs (``messages``, ``input``, ``max_completion_tokens``, ``tools``...) are a
  400 that names the field to use or the route to send it to (as ``request_checks`` does).
"""

from __future__ import annotations

from typing import Any

from gymserve.convert.request_checks import json_type, number, without_nulls
from gymserve.errors import InvalidRequestError

MAX_N = 128
"""The most choices per prompt (the OpenAI API's limit for ``n``)."""
MAX_CHOICES = 1024
"""The most choices one request may ask for, prompts × ``n``."""
DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` when the request sends none (the OpenAI API's and vLLM's default for completions)."""

_CHAT = "send it to /v1/chat/completions, which renders messages through the chat template"
_OTHER_FIELDS: dict[str, str] = {
    "messages": "/v1/completions takes a prompt (text or token IDs); for a conversation, " + _CHAT,
    "input": "use prompt: a string, a list of strings, a list of token IDs or a list of such lists",
    "instructions": "put them in the prompt text",
    "max_output_tokens": "use max_tokens",
    "max_completion_tokens": "use max_tokens",
    "tools": "/v1/completions has no tools; " + _CHAT,
    "tool_choice": "/v1/completions has no tools; " + _CHAT,
    "functions": "/v1/completions has no tools; " + _CHAT,
    "function_call": "/v1/completions has no tools; " + _CHAT,
    "response_format": "/v1/completions has no structured output; " + _CHAT,
    "reasoning": "/v1/completions has no reasoning options; send a prompt",
    "reasoning_effort": "/v1/completions has no reasoning options; send a prompt",
    "text": "/v1/completions has no text options; send a prompt",
    "top_logprobs": "use logprobs (an integer from 0 to 20): the legacy API's alternatives per token",
    "required_prefix_token_ids": "give the whole prompt as token IDs in prompt instead",
}

# (key, integer?, low, high): ranges the OpenAI API and vLLM both accept.
_NUMBERS = (
    ("max_tokens", True, 1, None),
    ("n", True, 1, MAX_N),
    ("logprobs", True, 0, 20),
    ("prompt_logprobs", True, 0, 20),
    ("temperature", False, 0, None),
    ("top_p", False, 0, 1),
    ("presence_penalty", False, -2, 2),
    ("frequency_penalty", False, -2, 2),
    ("seed", True, None, None),
    ("best_of", True, 1, None),
)
_BOOLS = ("echo", "stream", "return_tokens_as_token_ids", "return_token_ids", "add_special_tokens")


def check_completions_request(request: Any) -> dict[str, Any]:
    """The request with its top-level nulls dropped, checked; ``prompt`` left as sent (see
    :func:`prompts`). Raises ``InvalidRequestError`` (400, ``param`` naming the field) for what the
    module docstring lists."""
    if not isinstance(request, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {json_type(request)}")
    request = without_nulls(request)
    for key in request:
        if key in _OTHER_FIELDS:
            raise InvalidRequestError(
                f"{key} is not a field of POST /v1/completions: {_OTHER_FIELDS[key]}",
                param=key,
                code="unsupported_parameter",
            )
    if "model" in request and not isinstance(request["model"], str):
        raise InvalidRequestError(f"model must be a string, got {json_type(request['model'])}", param="model")
    for key, integer, low, high in _NUMBERS:
        number(request, key, integer=integer, low=low, high=high)
    for key in _BOOLS:
        if key in request and not isinstance(request[key], bool):
            raise InvalidRequestError(f"{key} must be true or false, got {json_type(request[key])}", param=key)
    if request.get("suffix"):
        raise InvalidRequestError(
            "suffix (insert mode) is not supported: the model continues the prompt only, as in vLLM; put "
            "the text before the insertion point in prompt and leave suffix out",
            param="suffix",
        )
    if "suffix" in request and not isinstance(request["suffix"], str):
        raise InvalidRequestError(f"suffix must be a string, got {json_type(request['suffix'])}", param="suffix")
    best_of = request.get("best_of")
    if best_of is not None and best_of != request.get("n", 1):
        raise InvalidRequestError(
            f"best_of={best_of} is not supported (vLLM's V1 engine refuses it too): sample n choices with "
            "logprobs and rank them yourself; leave best_of out or equal to n",
            param="best_of",
        )
    stop = request.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {json_type(stop)}", param="stop")
    options = request.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequestError(
            'stream_options must be an object such as {"include_usage": true}', param="stream_options"
        )
    if "logit_bias" in request and not isinstance(request["logit_bias"], dict):
        raise InvalidRequestError(
            f"logit_bias must be an object, got {json_type(request['logit_bias'])}", param="logit_bias"
        )
    total = len(prompts(request)) * request.get("n", 1)
    if total > MAX_CHOICES:
        raise InvalidRequestError(
            f"this request asks for {total} choices (prompts × n); send at most {MAX_CHOICES} per request",
            param="prompt",
        )
    return request


def prompts(request: dict[str, Any]) -> list[str | list[int]]:
    """``prompt`` as a list of prompts, each a string or a list of token IDs (elements not checked
    against a vocabulary here: the backend does that, naming ``prompt[i][j]``).

    Raises ``InvalidRequestError`` (param ``prompt``) when it is missing, empty, or not one of the
    four forms (a string, a list of strings, a list of integers, a list of lists of integers)."""
    prompt = request.get("prompt")
    forms = "a string, a list of strings, a list of token IDs, or a list of lists of token IDs"
    if prompt is None:
        raise InvalidRequestError(f"prompt is required: {forms}", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        got = "an empty array" if prompt == [] else json_type(prompt)
        raise InvalidRequestError(f"prompt must be {forms}, got {got}", param="prompt")
    if all(type(p) is int for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p or not all(type(t) is int for t in p):
                raise InvalidRequestError(
                    f"prompt[{i}] must be a non-empty list of token IDs (integers)", param=f"prompt[{i}]"
                )
        return list(prompt)
    raise InvalidRequestError(f"prompt must be {forms}; this list mixes them", param="prompt")
