"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints (beside ``/v1``, as vLLM has them).

=========================  ===================================================================
route                      body → answer
=========================  ===================================================================
``POST /tokenize``         prompt form ``{"prompt", "add_special_tokens", "return_token_strs"}`` or
                           chat form ``{"messages", "add_generation_prompt",
                           "continue_final_message", "add_special_tokens", "tools",
                           "chat_template_kwargs", "return_token_strs",
                           "required_prefix_token_ids"}`` → ``{"count", "max_model_len",
                           "tokens", "token_strs"}`` (``token_strs`` null unless asked)
``POST /detokenize``       ``{"tokens": [...]}`` → ``{"prompt": text}``
=========================  ===================================================================

The chat form answers the token IDs generation would see for the same messages: on the local
backend, the prefix splice and ``required_prefix_token_ids`` applied (``prompting.build_prompt``,
the function the chat route runs); on a chat backend, the upstream's ``/tokenize`` or gymserve's own
tokenizer (``backend.tokenizer``). Bodies are checked by ``convert.tokenize_request``; errors are
OpenAI error objects (400 naming the field, 501 on a backend that cannot tokenize, 502 when the
upstream fails). Like every route but ``/health``, they take the server's API key when one is set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from gymserve.backends.base import Backend, RequestContext
from gymserve.convert.tokenize_request import check_detokenize_request, check_tokenize_request

TOKEN_PATHS = frozenset({"/tokenize", "/detokenize"})


def install_tokens(
    app: FastAPI,
    backend: Backend,
    *,
    read_json: Callable[[Request], Awaitable[dict[str, Any]]],
    context: Callable[[Request], RequestContext],
) -> None:
    """Mount ``/tokenize`` and ``/detokenize`` on ``app`` over ``backend``. ``read_json`` parses a
    request's body into a JSON object and ``context`` reads its session and request id (the app's
    own, so size limits, bad-JSON errors and session affinity are those of the model calls). The
    OpenAPI entries are ``server.schemas``'."""

    async def tokenize(request: Request) -> Response:
        body = check_tokenize_request(await read_json(request))
        return _json(await backend.tokenize(body, context(request)))

    async def detokenize(request: Request) -> Response:
        body = check_detokenize_request(await read_json(request))
        return _json(await backend.detokenize(body, context(request)))

    # Plain routes, as the model-call routes: the body is parsed and checked by hand.
    app.add_route("/tokenize", tokenize, methods=["POST"], include_in_schema=False)
    app.add_route("/detokenize", detokenize, methods=["POST"], include_in_schema=False)


def _json(data: dict[str, Any]) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")
