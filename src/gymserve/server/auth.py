"""The server's own API key: clients present it as ``Authorization: Bearer <key>`` (the openai SDK's
``api_key``), as ``api-key: <key>`` (Azure's spelling) or as ``x-api-key: <key>`` (Anthropic's: the
anthropic SDK's ``api_key``), compared in constant time; every route but ``/health`` requires it,
unknown routes included (a 404 would tell a stranger what exists). The refusal is an OpenAI error
object, or Anthropic's on the Messages API's routes.

The control routes (``server.control_routes.CONTROL_PATHS``: pause, weight updates) take the admin key
instead when ``server.admin_api_key`` is set, so rollout workers holding the server key cannot
swap the policy; without an admin key they take the server key.

A pure ASGI middleware (no ``BaseHTTPMiddleware``): it looks at the headers only, never reads the
body, and adds nothing to an authorized request but one ``hmac.compare_digest``.
"""

from __future__ import annotations

import hmac

import orjson

from gymserve.server.errors import is_anthropic_route
from gymserve.wire.anthropic_errors import error_body

OPEN_PATHS = frozenset({"/health"})


def _refusal(message: str) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    )


_BODY = _refusal(
    "missing or wrong API key: send 'Authorization: Bearer <key>' (the server was started with an API key)"
)
_ANTHROPIC_BODY = orjson.dumps(
    error_body(401, "missing or wrong API key: send 'x-api-key: <key>' (the server was started with an API key)")
)
_ADMIN_BODY = _refusal(
    "missing or wrong admin API key: control routes (pause, weight updates) need "
    "'Authorization: Bearer <key>' with server.admin_api_key (the server API key when no admin key is set)"
)


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key the client sent (bytes; empty when none)."""
    auth = api_key = b""
    for name, value in headers:
        if name == b"authorization":
            auth = value
        elif name in (b"api-key", b"x-api-key"):
            api_key = value
    if auth:
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer":
            return token.strip()
    return api_key.strip()


class ApiKeyMiddleware:
    """401 (OpenAI error object, ``WWW-Authenticate: Bearer``) for any request without the key.

    ``key`` None leaves the non-control routes open; ``admin_key`` guards ``admin_paths`` (default:
    ``key`` guards them too)."""

    def __init__(
        self,
        app,
        key: str | None,
        on_failure=None,
        *,
        admin_key: str | None = None,
        admin_paths: frozenset[str] = frozenset(),
    ):
        self.app = app
        self.expected = key.encode() if key else None
        self.admin = admin_key.encode() if admin_key else self.expected
        self.admin_paths = admin_paths
        self.on_failure = on_failure

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        admin = scope["path"] in self.admin_paths
        expected = self.admin if admin else self.expected
        if expected is None or hmac.compare_digest(presented_key(scope["headers"]), expected):
            return await self.app(scope, receive, send)
        if self.on_failure is not None:
            self.on_failure()
        body = _ADMIN_BODY if admin else _ANTHROPIC_BODY if is_anthropic_route(scope["path"]) else _BODY
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def install_api_key_check(
    app, key: str | None, on_failure=None, *, admin_key: str | None = None, admin_paths: frozenset[str] = frozenset()
) -> None:
    """Require ``key`` on every route but ``/health`` and ``admin_key`` (else ``key``) on ``admin_paths``."""
    app.add_middleware(ApiKeyMiddleware, key=key, on_failure=on_failure, admin_key=admin_key, admin_paths=admin_paths)
