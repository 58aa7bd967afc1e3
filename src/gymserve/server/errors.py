"""Every failure becomes an OpenAI error object (``{"error": {message, type, param, code}}``).

``GymserveError`` carries its own status; FastAPI's validation errors and unknown routes become
400/404/405 in the same shape; anything unexpected is logged with its traceback and answered 500
with a message that says it is a gymserve bug (never a bare "Internal Server Error").
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gymserve.errors import GymserveError, OverloadedError

log = logging.getLogger("gymserve.server")


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """A JSON error response in the OpenAI shape."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GymserveError)
    async def _gymserve(request: Request, exc: GymserveError):
        headers = None
        if isinstance(exc, OverloadedError):
            headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
        if exc.status_code >= 500:
            log.warning("%s %s -> %d %s", request.method, request.url.path, exc.status_code, exc.message)
        return error_response(
            exc.status_code, exc.message, type_=exc.error_type, param=exc.param, code=exc.code, headers=headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(
            400, f"invalid request: {first.get('msg', 'validation failed')}", type_="invalid_request_error", param=param
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = (
                f"no route {request.method} {request.url.path}; gymserve serves POST /v1/responses, "
                "POST /v1/chat/completions, GET /v1/models and GET /health (is /v1 missing from the base URL?)"
            )
        else:
            msg = str(exc.detail)
        return error_response(
            exc.status_code,
            msg,
            type_="invalid_request_error" if exc.status_code < 500 else "server_error",
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500,
            f"internal error in gymserve ({type(exc).__name__}); this is a bug, please report it with the server log",
            type_="server_error",
        )
