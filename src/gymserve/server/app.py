"""The HTTP server: OpenAI-compatible routes over one backend.

Routes: ``POST /v1/responses``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API, its errors
in Anthropic's shape), ``POST /tokenize`` and ``POST /detokenize`` (``server.tokens``),
``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus; ``server.metrics``), ``GET /``: a small JSON status (name,
version, backend, model, links), as NeMo Gym's servers answer there, and the control routes of
``server.control_routes`` (pause, resume, weight updates, LoRA adapters). Every model call is timed and
counted per backend and replica (``ctx.extra["replica"]``, set by the backend) and, with
``capture_path``, written to a JSONL capture file (``server.capture``).
Bodies are parsed as plain JSON (orjson), checked by ``convert.request_checks.check_request``
(top-level nulls dropped; the other API's fields refused, naming the field to use; chat tools and
numbers) and handed to the backend as dicts; the backend and the converter validate what they use
and raise ``GymserveError`` subclasses, which become OpenAI error objects with the right status.
The request schemas in the OpenAPI document are the openai SDK's own, published for clients and
fuzzers, not re-validated per request (that would dominate the cost of a 100 KB multi-turn
history).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from gymserve._version import __version__
from gymserve.backends.base import Backend, RequestContext
from gymserve.convert.completions_request import check_completions_request
from gymserve.convert.messages_fields import check_top_level
from gymserve.convert.request_checks import check_request, without_nulls
from gymserve.convert.tool_pairing import check_tool_pairing
from gymserve.errors import GymserveError, InvalidRequestError, ShuttingDownError
from gymserve.server.capture import CaptureWriter, install_log_redaction
from gymserve.server.control_routes import CONTROL_PATHS, LORA_PATHS, control_health, install_control
from gymserve.server.disconnect import ClientLeft, until_disconnected
from gymserve.server.errors import anthropic_status, error_response, install_error_handlers, is_anthropic_route
from gymserve.server.known_fields import UnknownQueryCheck, check_body_fields
from gymserve.server.limits import read_body
from gymserve.server.metrics import Metrics, usage_tokens
from gymserve.server.schemas import install_openapi
from gymserve.server.tokens import install_tokens
from gymserve.server.weight_sync_routes import WEIGHT_SYNC_PATHS, install_weight_sync, weight_sync_health
from gymserve.wire.anthropic_errors import error_body

log = logging.getLogger("gymserve.server")
SESSION_HEADER = "x-session-id"
SESSION_COOKIE = "session_id"
Wire = Literal["responses", "chat", "completions", "messages"]
_MODEL_CALL_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/messages"})
"""What a model route speaks: its request checks, its stream format, its error shape."""


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def _body(request: Request, max_bytes: int) -> dict[str, Any]:
    raw = await read_body(request, max_bytes)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


def _checked(body: dict[str, Any], api: Wire, tokens_as_ids: bool = False) -> dict[str, Any]:
    """``body`` after the checks every backend shares (``check_request`` on the OpenAI chat and
    Responses routes; the completions route's ``check_completions_request``; the Messages converter
    checks its own fields), top-level nulls dropped, ``stream`` a boolean. ``tokens_as_ids`` (the
    server's ``--return-tokens-as-token-ids``) makes ``return_tokens_as_token_ids`` true on chat and
    completions requests that do not send it, as vLLM's server flag does (a request's own value,
    ``false`` included, wins: ``serving_chat.py``'s ``_create_chat_logprobs``)."""
    if api == "messages":
        body = without_nulls(body)
        check_top_level(body)  # another API's field: a 400 naming the Messages field to use
        check_tool_pairing(body.get("messages"))  # Anthropic's rules, before any backend sees it
    elif api == "completions":
        body = check_completions_request(body)
    else:
        body = check_request(body, api)
    check_body_fields(body, api)
    if tokens_as_ids and api in ("chat", "completions") and "return_tokens_as_token_ids" not in body:
        body = {**body, "return_tokens_as_token_ids": True}
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequestError(f"stream must be true or false, got {type(stream).__name__}", param="stream")
    return body


def _error_info(exc: BaseException) -> tuple[int, str, dict[str, Any] | None]:
    """(HTTP status, error type, error object) that ``exc`` becomes; 499 for a client that left."""
    if isinstance(exc, GymserveError):
        return exc.status_code, exc.error_type, exc.to_dict()
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return 499, "cancelled", None
    return 500, "server_error", {"error": {"message": f"unexpected {type(exc).__name__}", "type": "server_error"}}


def _context(request: Request) -> RequestContext:
    session = request.headers.get(SESSION_HEADER) or request.cookies.get(SESSION_COOKIE)
    return RequestContext(session_id=session, request_id=request.headers.get("x-request-id") or uuid.uuid4().hex)


def _sse(events: AsyncIterator[dict[str, Any]], *, api: Wire) -> StreamingResponse:
    """Server-sent events: ``event:`` lines for the Responses and Messages APIs, ``data:`` chunks ending with ``data: [DONE]`` for chat and completions."""

    async def body():
        seq = -1  # the last sequence_number sent (Responses), so an error event can follow it
        try:
            async for ev in events:
                data = orjson.dumps(ev)
                if api in ("responses", "messages"):
                    if isinstance(ev.get("sequence_number"), int):
                        seq = ev["sequence_number"]
                    yield b"event: " + ev["type"].encode() + b"\ndata: " + data + b"\n\n"
                else:
                    yield b"data: " + data + b"\n\n"
        except GymserveError as exc:
            # Headers are gone once streaming started: the error travels as an event.
            error = exc.to_dict()["error"]
            if api == "messages":
                error["status"] = anthropic_status(exc)
            yield _error_event(error, api=api, seq=seq)
        except Exception as exc:  # noqa: BLE001 - a bug mid-stream still ends the stream cleanly
            log.exception("unhandled error while streaming")
            err = {
                "message": f"internal error in gymserve ({type(exc).__name__}) while streaming; "
                "this is a bug, please report it with the server log",
                "type": "server_error",
                "code": None,
                "param": None,
            }
            yield _error_event(err, api=api, seq=seq)
        if api in ("chat", "completions"):
            yield b"data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _error_event(error: dict[str, Any], *, api: Wire, seq: int) -> bytes:
    """The last event of a stream that failed after its headers were sent.

    Responses: an ``error`` event with the next ``sequence_number``, carrying the error both as the
    OpenAI API does (top-level ``code``, ``message``, ``param``: the SDK's ``ResponseErrorEvent``) and
    as the Open Responses spec does (``error: {type, code, message, param}``); the openai SDK raises
    the latter as ``APIError``. Chat and completions: ``{"error": {message, type, param, code}}``, the shape OpenAI
    and vLLM send mid-stream, which the SDK raises as ``APIError`` (a ``{"type": "error", ...}``
    chunk would reach the client as a chat chunk without choices). Messages: Anthropic's error
    object (``status`` in ``error`` picks its type), which the anthropic SDK raises as ``APIStatusError``.
    """
    payload: dict[str, Any]
    if api == "messages":
        payload = error_body(error.get("status") or 500, error.get("message") or "")
    elif api == "responses":
        payload = {
            "type": "error",
            "sequence_number": seq + 1,
            "code": error.get("code"),
            "message": error.get("message"),
            "param": error.get("param"),
            "error": {
                "type": error.get("type") or "server_error",
                "code": error.get("code"),
                "message": error.get("message"),
                "param": error.get("param"),
            },
        }
    else:
        payload = {"error": error}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


def create_app(
    backend: Backend,
    *,
    max_body_bytes: int = 16 << 20,
    server_api_key: str | None = None,
    served_models: list[str] | None = None,
    capture_path: str | None = None,
    secrets: tuple[str, ...] = (),
    admin_api_key: str | None = None,
    control_allowed: bool = True,
    tokens_as_ids: bool = False,
) -> FastAPI:
    """Build the FastAPI app over ``backend``. The caller owns the backend's lifetime and calls
    ``close_app`` when the server has stopped (it flushes the capture file).

    ``capture_path``: append every model call to this JSONL file (``server.capture``), redacting
    ``secrets``, the backend's upstream keys and ``server_api_key``. ``admin_api_key`` guards the
    control routes instead of ``server_api_key``; ``control_allowed`` False answers them 403
    (``server.control_routes.control_allowed`` decides it from the bind address). ``tokens_as_ids``:
    vLLM's ``--return-tokens-as-token-ids`` (``_checked``).
    """
    app = FastAPI(
        title="gymserve",
        version=__version__,
        description="Token-exact Responses API and Chat Completions server for RL of LLM agents.",
    )
    app.state.backend = backend
    app.state.draining = False
    app.state.metrics = metrics = Metrics(backend)
    install_error_handlers(app)

    @app.exception_handler(ShuttingDownError)
    async def _draining(request: Request, exc: ShuttingDownError):
        return error_response(
            503,
            exc.message,
            type_=exc.error_type,
            code=exc.code,
            headers={"Retry-After": "1", "Connection": "close"},
            anthropic=is_anthropic_route(request.url.path),
        )

    install_openapi(app)
    # One rule for unknown query parameters on every route (server.known_fields).
    app.add_middleware(UnknownQueryCheck, routes=lambda: app.routes)
    all_secrets = tuple(s for s in (*backend.secrets, server_api_key, admin_api_key, *secrets) if s)
    install_log_redaction(all_secrets)
    app.state.capture = capture = (
        CaptureWriter(capture_path, secrets=all_secrets, on_drop=metrics.capture_dropped.inc) if capture_path else None
    )
    if server_api_key or admin_api_key:
        from gymserve.server.auth import install_api_key_check

        install_api_key_check(
            app,
            server_api_key,
            on_failure=metrics.auth_failures.inc,
            admin_key=admin_api_key,
            admin_paths=CONTROL_PATHS | LORA_PATHS | WEIGHT_SYNC_PATHS,
        )
    install_control(app, backend, allowed=control_allowed, registry=metrics.registry)
    install_weight_sync(app, backend, allowed=control_allowed)
    backend_name = backend.name
    default_replica = "local" if backend_name == "local" else "-"

    def record(
        route: str,
        ctx: RequestContext | None,
        body: Any,
        t0: float,
        status: int,
        *,
        result: Any = None,
        error: dict[str, Any] | None = None,
        error_type: str | None = None,
        stream: bool = False,
    ) -> None:
        seconds = time.perf_counter() - t0
        replica = (ctx.extra.get("replica") if ctx is not None else None) or default_replica
        metrics.observe(
            route, backend_name, replica, status, seconds, usage_tokens(result) if status == 200 else (0, 0), error_type
        )
        if capture is not None:
            capture.record(
                route=route,
                request_id=ctx.request_id if ctx else None,
                session=ctx.session_id if ctx else None,
                backend=backend_name,
                replica=replica,
                status=status,
                latency_s=round(seconds, 6),
                stream=stream,
                request=body,
                **({"error": error} if error is not None else {"response": result}),
            )

    async def serve(route: str, request: Request, call, call_stream, api: Wire) -> Response:
        """One model call: parse, call the backend, record metrics and capture; errors propagate
        to the error handlers after being recorded. ``api`` says which checks the body gets and
        how it streams and fails (``Wire``)."""
        t0 = time.perf_counter()
        gauge = metrics.gauge(route)
        gauge.inc()
        body: Any = None
        ctx: RequestContext | None = None
        try:
            if app.state.draining:
                raise ShuttingDownError()
            body = await _body(request, max_body_bytes)  # kept as sent for the capture file if a check fails
            checked = _checked(body, api, tokens_as_ids)
            ctx = _context(request)
            stream = checked.get("stream")
            if stream:
                events = await until_disconnected(request, _first_then_rest(call_stream(checked, ctx)))
            else:
                result = await until_disconnected(request, call(checked, ctx))
        except ClientLeft:  # nobody to answer: its work was cancelled (server.disconnect)
            gauge.dec()
            record(route, ctx, body, t0, 499, error_type="cancelled")
            return Response(status_code=499)
        except BaseException as exc:
            gauge.dec()
            status, etype, err = _error_info(exc)
            record(route, ctx, body, t0, status, error=err, error_type=etype)
            raise
        if not stream:
            gauge.dec()
            record(route, ctx, body, t0, 200, result=result)
            return _json(result)

        def done(*a: Any, **k: Any) -> None:
            gauge.dec()
            record(route, ctx, body, t0, *a, **k)

        return _sse(_observed(events, done, keep=capture is not None, api=api), api=api)

    async def chat_completions(request: Request):
        return await serve("/v1/chat/completions", request, backend.chat, backend.chat_stream, "chat")

    async def responses(request: Request):
        return await serve("/v1/responses", request, backend.responses, backend.responses_stream, "responses")

    async def completions(request: Request):
        return await serve("/v1/completions", request, backend.completions, backend.completions_stream, "completions")

    async def messages(request: Request):
        return await serve("/v1/messages", request, backend.messages, backend.messages_stream, "messages")

    async def count_tokens(request: Request):
        """Anthropic's ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, no generation."""
        if app.state.draining:
            raise ShuttingDownError()
        body = without_nulls(await _body(request, max_body_bytes))
        check_top_level(body)
        check_body_fields(body, "count_tokens")
        check_tool_pairing(body.get("messages"))
        return _json({"input_tokens": await backend.count_tokens(body, _context(request))})

    async def tokens_in(route: str, request: Request, call) -> Response:
        """vLLM's ``/inference/v1/generate`` and SGLang's ``/generate`` (``backends.local.tokens_in``):
        a JSON body to the backend, the answer as JSON; metrics and capture as the model calls."""
        t0 = time.perf_counter()
        body: Any = None
        ctx = _context(request)
        try:
            if app.state.draining:
                raise ShuttingDownError()
            body = await _body(request, max_body_bytes)
            result = await until_disconnected(request, call(body, ctx))
        except ClientLeft:
            record(route, ctx, body, t0, 499, error_type="cancelled")
            return Response(status_code=499)
        except BaseException as exc:
            status, etype, err = _error_info(exc)
            record(route, ctx, body, t0, status, error=err, error_type=etype)
            raise
        record(route, ctx, body, t0, 200, result=result)
        return _json(result)

    async def generate_tokens(request: Request):
        return await tokens_in("/inference/v1/generate", request, backend.generate_tokens)

    async def sglang_generate(request: Request):
        return await tokens_in("/generate", request, backend.sglang_generate)

    # Plain Starlette routes: the body is parsed by hand anyway, and FastAPI's per-request
    # dependency solving was measurable on the hot path. install_openapi documents them.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/responses", responses, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/completions", completions, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/messages", messages, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/messages/count_tokens", count_tokens, methods=["POST"], include_in_schema=False)
    app.add_route("/inference/v1/generate", generate_tokens, methods=["POST"], include_in_schema=False)
    app.add_route("/generate", sglang_generate, methods=["POST"], include_in_schema=False)
    install_tokens(app, backend, read_json=lambda request: _body(request, max_body_bytes), context=_context)

    @app.get("/v1/models")
    async def models():
        """vLLM's model list: each served name with ``max_model_len`` (the context window: prompt +
        generation tokens) where the backend knows it (local and Ray backends)."""
        names = served_models or await backend.models()
        now = int(time.time())
        window = backend.describe().get("context_window")
        card = {"object": "model", "created": now, "owned_by": "gymserve"}
        if isinstance(window, int):
            card["max_model_len"] = window
        return _json({"object": "list", "data": [{"id": n, **card} for n in names]})

    @app.get("/", summary="Server status")
    async def root_status():
        """What this server is: name, version, backend type, model, and links to the other routes
        (NeMo Gym's servers answer a status at ``/``; ``/health`` is the readiness probe)."""
        try:
            names = served_models or await asyncio.wait_for(backend.models(), 5)
        except Exception as exc:  # noqa: BLE001 - an upstream that cannot list models must not fail the status
            log.info("GET /: the backend could not list its models: %s", getattr(exc, "message", exc))
            names = []
        return _json(
            {
                "name": "gymserve",
                "version": __version__,
                "backend": backend_name,
                "model": names[0] if names else None,
                "models": list(names),
                "links": {
                    "health": "/health",
                    "models": "/v1/models",
                    "docs": "/docs",
                    "openapi": "/openapi.json",
                    "responses": "/v1/responses",
                    "chat_completions": "/v1/chat/completions",
                    "completions": "/v1/completions",
                    "messages": "/v1/messages",
                    "tokenize": "/tokenize",
                },
            }
        )

    @app.get("/health")
    async def health():
        if app.state.draining:
            return _json({"status": "draining"}, status=503)
        info = {**await backend.health(), **control_health(backend), **weight_sync_health(app)}
        return _json(info, status=200 if info.get("status") != "down" else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    # The model calls' routes first: Starlette tries routes in order with a regex match each (a few
    # µs apiece), and the 16 docs, control and LoRA routes before them cost every call ~40 µs
    # (issue #30). Every path is exact, so the order decides nothing else.
    app.router.routes.sort(key=lambda route: getattr(route, "path", None) not in _MODEL_CALL_PATHS)
    return app


def close_app(app: FastAPI) -> None:
    """Flush and close what the app owns (the capture file); the backend is the caller's."""
    capture = getattr(app.state, "capture", None)
    if capture is not None:
        capture.close()


async def _observed(
    events: AsyncIterator[dict[str, Any]], done, *, keep: bool, api: Wire
) -> AsyncIterator[dict[str, Any]]:
    """Pass stream events through; when the stream ends, ``done(status, result=..., ...)`` records
    it: the final Response (Responses API), or the last usage with the chunks (chat) or events
    (Messages: the ``message_delta`` carries the usage), kept only for capture."""
    status, etype, err = 200, None, None
    kept: list[dict[str, Any]] = []
    final: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    try:
        async for ev in events:
            kind = ev.get("type")
            if api == "responses":
                if kind in ("response.completed", "response.incomplete", "response.failed"):
                    final = ev.get("response")
                    if kind == "response.failed":
                        etype = "response_failed"
                elif kind == "error":
                    etype = "stream_error"
            else:
                if api == "messages" and kind == "error":
                    etype = "stream_error"
                if isinstance(ev.get("usage"), dict):
                    usage = ev["usage"]
                if keep and len(kept) < 100_000:
                    kept.append(ev)
            yield ev
    except BaseException as exc:
        status, etype, err = _error_info(exc)
        raise
    finally:
        if api == "responses":
            result = final
        else:
            result = (
                {"usage": usage, "chunks" if api in ("chat", "completions") else "events": kept}
                if keep
                else {"usage": usage}
            )
        done(status, result=result, error=err, error_type=etype, stream=True)


async def _first_then_rest(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Pull the first event before the response starts, so request errors (bad input, context
    length) still become a plain 4xx JSON error instead of an event inside a 200 stream."""
    it = aiter(events)
    first = await anext(it, None)
    if first is None:
        return it  # exhausted: iterating it again yields nothing

    async def rest():
        yield first
        async for ev in it:
            yield ev

    return rest()
