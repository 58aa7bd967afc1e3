"""Request limits and the shutdown gate: body size, and refusing new calls while draining.

``read_body`` refuses an oversized body from its ``Content-Length`` before reading any of it, and
stops reading a chunked body as soon as it passes the limit, so a client cannot make the server
buffer more than ``server.max_body_bytes`` (``errors.RequestTooLargeError``, 413).
``errors.ShuttingDownError`` (503, ``Retry-After``) is what a request gets once SIGTERM has started
the graceful shutdown (``server.run``).
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from gymserve.errors import InvalidRequestError, RequestTooLargeError


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` (``RequestTooLargeError`` beyond, 413)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise InvalidRequestError(
                f"Content-Length {declared[:40]!r} is not a number", code="invalid_content_length"
            ) from None
        if n > max_bytes:
            raise RequestTooLargeError(n, max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RequestTooLargeError(f"more than {max_bytes}", max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise InvalidRequestError(
            "the client disconnected while sending the body", code="client_disconnected"
        ) from None
    return b"".join(chunks)
