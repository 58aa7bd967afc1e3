"""The server's own API key: clients present it as ``Authorization: Bearer <key>`` (the openai SDK's
``api_key``), compared in constant time; every route but ``/health`` requires it."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from gymserve.server.errors import error_response

OPEN_PATHS = frozenset({"/health"})


def install_api_key_check(app: FastAPI, key: str) -> None:
    expected = key.encode()

    @app.middleware("http")
    async def _check(request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip() if scheme.lower() == "bearer" else request.headers.get("api-key", "")
        if not hmac.compare_digest(presented.encode(), expected):
            return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                  "(the server was started with an API key)", type_="authentication_error",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)
