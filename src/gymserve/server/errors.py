"""Every failure becomes an OpenAI error object (``{"error": {message, type, param, code}}``), or
on the Anthropic routes (``/v1/messages``, ``/v1/messages/count_tokens``) Anthropic's
(``{"type": "error", "error": {type, message}}``, ``wire.anthropic_errors``).

``GymserveError`` carries its own status (on the Anthropic routes a full queue, ``OverloadedError``,
is Anthropic's 529 ``overloaded_error``); FastAPI's validation errors and unknown routes become
400/404/405 in the same shape; anything unexpected is logged with its traceback and answered 500
with a message that says it is a gymserve bug (never a bare "Internal Server Error").
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gymserve.errors import GymserveError, OverloadedError, UpstreamRateLimitedError
from gymserve.wire.anthropic_errors import OVERLOADED_STATUS, error_body

log = logging.getLogger("gymserve.server")
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


def is_anthropic_route(path: str) -> bool:
    """Whether ``path`` answers in Anthropic's shapes (the Messages API's routes)."""
    return path in ANTHROPIC_ROUTES


def anthropic_status(exc: GymserveError) -> int:
    """The status ``exc`` has on an Anthropic route: gymserve's own full queue is Anthropic's 529
    ``overloaded_error``; everything else keeps its status (an upstream's 429 stays a rate limit)."""
    if isinstance(exc, OverloadedError) and not isinstance(exc, UpstreamRateLimitedError):
        return OVERLOADED_STATUS
    return exc.status_code


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    anthropic: bool = False,
) -> Response:
    """A JSON error response in the OpenAI shape, or (``anthropic``) in Anthropic's."""
    if anthropic:
        body: dict = error_body(status, message)
    else:
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def route_list(app: Any) -> str:
    """Every route ``app`` serves, ``METHOD /path`` in path order (``HEAD`` left out: it rides on
    ``GET``), read from the app itself so that a new route is listed without editing a message."""
    seen: dict[str, list[str]] = {}
    for route in getattr(app, "routes", []):
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if path and methods:
            seen.setdefault(path, []).extend(sorted(m for m in methods if m != "HEAD"))
    return ", ".join(f"{m} {path}" for path in sorted(seen) for m in dict.fromkeys(seen[path]))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GymserveError)
    async def _gymserve(request: Request, exc: GymserveError):
        headers = None
        if isinstance(exc, OverloadedError):
            headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
        if exc.status_code >= 500:
            log.warning("%s %s -> %d %s", request.method, request.url.path, exc.status_code, exc.message)
        anthropic = is_anthropic_route(request.url.path)
        return error_response(
            anthropic_status(exc) if anthropic else exc.status_code,
            exc.message,
            type_=exc.error_type,
            param=exc.param,
            code=exc.code,
            headers=headers,
            anthropic=anthropic,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(
            400,
            f"invalid request: {first.get('msg', 'validation failed')}",
            type_="invalid_request_error",
            param=param,
            anthropic=is_anthropic_route(request.url.path),
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = (
                f"no route {request.method} {request.url.path} (is /v1 missing from the base URL?); "
                f"gymserve serves {route_list(request.app)}"
            )
        else:
            msg = str(exc.detail)
        return error_response(
            exc.status_code,
            msg,
            type_="invalid_request_error" if exc.status_code < 500 else "server_error",
            headers=getattr(exc, "headers", None),
            anthropic=is_anthropic_route(request.url.path),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500,
            f"internal error in gymserve ({type(exc).__name__}); this is a bug, please report it with the server log",
            type_="server_error",
            anthropic=is_anthropic_route(request.url.path),
        )
