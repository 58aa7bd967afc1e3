"""The HTTP server: OpenAI-compatible routes over one backend.

Routes: ``POST /v1/responses``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``.
Bodies are parsed as plain JSON (orjson) and handed to the backend as dicts; the backend and the
converter validate what they use and raise ``GymserveError`` subclasses, which become OpenAI error
objects with the right status. The request schemas in the OpenAPI document are the openai SDK's
own, published for clients and fuzzers, not re-validated per request (that would dominate the
cost of a 100 KB multi-turn history).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from gymserve.backends.base import Backend, RequestContext
from gymserve.errors import GymserveError, InvalidRequestError
from gymserve.server.errors import install_error_handlers
from gymserve.server.schemas import install_openapi

log = logging.getLogger("gymserve.server")
SESSION_HEADER = "x-session-id"
SESSION_COOKIE = "session_id"


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)


async def _body(request: Request, max_bytes: int) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > max_bytes:
        raise InvalidRequestError(f"request body is {len(raw)} bytes; the limit is {max_bytes} "
                                  "(server.max_body_bytes)", code="request_too_large")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(data).__name__}",
                                  code="invalid_json")
    return data


def _context(request: Request) -> RequestContext:
    session = request.headers.get(SESSION_HEADER) or request.cookies.get(SESSION_COOKIE)
    return RequestContext(session_id=session, request_id=request.headers.get("x-request-id") or uuid.uuid4().hex)


def _sse(events: AsyncIterator[dict[str, Any]], *, responses: bool) -> StreamingResponse:
    """Server-sent events: ``event:`` lines for the Responses API, ``data: [DONE]`` for chat."""

    async def body():
        try:
            async for ev in events:
                data = orjson.dumps(ev)
                if responses:
                    yield b"event: " + ev["type"].encode() + b"\ndata: " + data + b"\n\n"
                else:
                    yield b"data: " + data + b"\n\n"
        except GymserveError as exc:
            # Headers are gone once streaming started: the error travels as an event.
            yield b"event: error\ndata: " + orjson.dumps({"type": "error", **exc.to_dict()["error"]}) + b"\n\n"
        if not responses:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(backend: Backend, *, max_body_bytes: int = 16 << 20, server_api_key: str | None = None,
               served_models: list[str] | None = None) -> FastAPI:
    """Build the FastAPI app over ``backend``. The caller owns the backend's lifetime."""
    app = FastAPI(title="gymserve", version="0.1.0",
                  description="Token-exact Responses API and Chat Completions server for RL of LLM agents.")
    app.state.backend = backend
    install_error_handlers(app)
    install_openapi(app)
    if server_api_key:
        from gymserve.server.auth import install_api_key_check

        install_api_key_check(app, server_api_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request, max_body_bytes)
        ctx = _context(request)
        if body.get("stream"):
            return _sse(await _first_then_rest(backend.chat_stream(body, ctx)), responses=False)
        return _json(await backend.chat(body, ctx))

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await _body(request, max_body_bytes)
        ctx = _context(request)
        if body.get("stream"):
            return _sse(await _first_then_rest(backend.responses_stream(body, ctx)), responses=True)
        return _json(await backend.responses(body, ctx))

    @app.get("/v1/models")
    async def models():
        names = served_models or await backend.models()
        now = int(time.time())
        return _json({"object": "list", "data": [
            {"id": n, "object": "model", "created": now, "owned_by": "gymserve"} for n in names]})

    @app.get("/health")
    async def health():
        info = await backend.health()
        return _json(info, status=200 if info.get("status") != "down" else 503)

    return app


async def _first_then_rest(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Pull the first event before the response starts, so request errors (bad input, context
    length) still become a plain 4xx JSON error instead of an event inside a 200 stream."""
    it = aiter(events)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        return _empty()

    async def rest():
        yield first
        async for ev in it:
            yield ev

    return rest()


async def _empty():
    return
    yield  # pragma: no cover

