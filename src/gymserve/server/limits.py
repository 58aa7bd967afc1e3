"""Request limits and the shutdown gate: body size, and refusing new calls while draining.

``read_body`` refuses an oversized body from its ``Content-Length`` before reading any of it, and
stops reading a chunked body as soon as it passes the limit, so a client cannot make the server
buffer more than ``server.max_body_bytes`` (413). ``ShuttingDownError`` (503, ``Retry-After``) is
what a request gets once SIGTERM has started the graceful shutdown (``server.run``).
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from gymserve.errors import GymserveError, InvalidRequestError


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than ``server.max_body_bytes`` (413)."""

    status_code = 413

    def __init__(self, size: int | str, limit: int):
        super().__init__(f"request body is {size} bytes; the limit is {limit} (server.max_body_bytes)",
                         code="request_too_large")


class ShuttingDownError(GymserveError):
    """The server is draining for shutdown and takes no new calls (503)."""

    status_code = 503
    error_type = "server_error"

    def __init__(self):
        super().__init__("gymserve is shutting down and accepts no new requests; retry against another "
                         "instance or after it restarts", code="shutting_down")
        self.retry_after = 1.0


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` (``RequestTooLargeError`` beyond, 413)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise InvalidRequestError(f"Content-Length {declared[:40]!r} is not a number",
                                      code="invalid_content_length") from None
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
        raise InvalidRequestError("the client disconnected while sending the body", code="client_disconnected") from None
    return b"".join(chunks)
