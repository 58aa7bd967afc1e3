"""The server's own API key: clients present it as ``Authorization: Bearer <key>`` (the openai SDK's
``api_key``) or as ``api-key: <key>`` (Azure's spelling), compared in constant time; every route but
``/health`` requires it, unknown routes included (a 404 would tell a stranger what exists).

A pure ASGI middleware (no ``BaseHTTPMiddleware``): it looks at the headers only, never reads the
body, and adds nothing to an authorized request but one ``hmac.compare_digest``.
"""

from __future__ import annotations

import hmac

import orjson

OPEN_PATHS = frozenset({"/health"})

_BODY = orjson.dumps({"error": {
    "message": "missing or wrong API key: send 'Authorization: Bearer <key>' (the server was started with an API key)",
    "type": "authentication_error", "param": None, "code": "invalid_api_key"}})


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key the client sent (bytes; empty when none)."""
    auth = api_key = b""
    for name, value in headers:
        if name == b"authorization":
            auth = value
        elif name == b"api-key":
            api_key = value
    if auth:
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer":
            return token.strip()
    return api_key.strip()


class ApiKeyMiddleware:
    """401 (OpenAI error object, ``WWW-Authenticate: Bearer``) for any request without the key."""

    def __init__(self, app, key: str, on_failure=None):
        self.app = app
        self.expected = key.encode()
        self.on_failure = on_failure

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if hmac.compare_digest(presented_key(scope["headers"]), self.expected):
            return await self.app(scope, receive, send)
        if self.on_failure is not None:
            self.on_failure()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _BODY})


def install_api_key_check(app, key: str, on_failure=None) -> None:
    app.add_middleware(ApiKeyMiddleware, key=key, on_failure=on_failure)
