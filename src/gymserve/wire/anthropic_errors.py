"""Anthropic's error shape and the HTTP status → error type table (the Messages API's "Errors" page).

Every error on ``/v1/messages`` is ``{"type": "error", "error": {"type", "message"}, "request_id"}``
with these statuses: 400 ``invalid_request_error`` (also "for other 4XX status codes not listed"),
401 ``authentication_error``, 403 ``permission_error``, 404 ``not_found_error``, 409
``conflict_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 500 ``api_error``, 504
``timeout_error``, 529 ``overloaded_error`` (the anthropic SDK's ``ErrorType``). Other 5xx are
``api_error``. A stream that fails after its 200 ends with the same object as an ``error`` event.
"""

from __future__ import annotations

from typing import Any

OVERLOADED_STATUS = 529
"""Anthropic's "the API is temporarily overloaded": gymserve's full queue (``OverloadedError``) on
``/v1/messages``, where the OpenAI routes answer 429."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    OVERLOADED_STATUS: "overloaded_error",
}


def error_type(status: int) -> str:
    """The Anthropic error type for an HTTP ``status`` (see the module docstring)."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(status: int, message: str, *, request_id: str | None = None) -> dict[str, Any]:
    """``{"type": "error", "error": {"type": error_type(status), "message": message}, "request_id"}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}, "request_id": request_id}
