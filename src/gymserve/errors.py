"""One exception hierarchy for everything a client can be told.

Every error carries the HTTP status and the fields of the OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``, as the OpenAI API returns them), so the server
turns any of them into a response without guessing. Messages say what was wrong and what to do.
"""

from __future__ import annotations

from typing import Any


class GymserveError(Exception):
    """Base class. ``status_code`` is the HTTP status; ``error_type``/``param``/``code`` fill the error object."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequestError(GymserveError):
    """The request is malformed or asks for something this server cannot do (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt leaves no room in the context window (400, code ``context_length_exceeded``).

    The message always contains the words "context length" and both token counts, which is what
    NeMo Gym and vLLM clients match on to end a rollout cleanly instead of retrying.
    """

    def __init__(self, prompt_tokens: int, context_window: int, *, param: str | None = "messages"):
        super().__init__(
            f"This model's maximum context length is {context_window} tokens, but the prompt has "
            f"{prompt_tokens} tokens, leaving no room to generate. Shorten the conversation.",
            param=param,
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


class SpliceError(InvalidRequestError):
    """The on-policy prefix splice could not find an unambiguous turn boundary (400, ``splice_failed``)."""

    def __init__(self, message: str):
        super().__init__(message, param="messages", code="splice_failed")




class WeightUpdateError(InvalidRequestError):
    """A weight update was refused before anything changed (400, code ``invalid_weights``): an
    unknown tensor name, a wrong shape or dtype, NaN/inf values, an unreadable file. ``param`` names
    the tensor or file; the old weights keep serving."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="invalid_weights")


class NotFoundError(InvalidRequestError):
    """The request names something this server does not have (404), e.g. a LoRA adapter that is not
    loaded or a model that is not served; ``type`` stays ``invalid_request_error`` as OpenAI's 404s."""

    status_code = 404


class NotSupportedError(GymserveError):
    """The backend or engine does not implement this operation (501 Not Implemented), e.g. weight
    updates on a backend that has no weights of its own; the message says what would."""

    status_code = 501
    error_type = "not_supported_error"


class ConflictError(GymserveError):
    """The operation cannot happen in the server's current state (409), e.g. a ``wait`` pause whose
    deadline passed before the in-flight calls finished."""

    status_code = 409
    error_type = "conflict_error"


class PermissionDeniedError(GymserveError):
    """The route is closed for this server (403), e.g. control endpoints on a non-loopback bind
    without any API key."""

    status_code = 403
    error_type = "permission_error"


class OverloadedError(GymserveError):
    """The backend's queue is full (429); ``retry_after`` seconds goes in the Retry-After header."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float = 1.0):
        super().__init__(message, code="overloaded")
        self.retry_after = retry_after


class UpstreamError(GymserveError):
    """The backend (a remote chat server, OpenAI, Azure) failed (502 unless it said otherwise).

    ``url`` is the URL tried (never with credentials); messages name the URL, the cause and the fix.
    """

    status_code = 502
    error_type = "upstream_error"

    def __init__(self, message: str, *, url: str | None = None, status_code: int | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message, param=param, code=code)
        self.url = url
        if status_code is not None:
            self.status_code = status_code


class UpstreamConnectionError(UpstreamError):
    """The backend could not be reached at all (DNS, refused, TLS, timeout) (502/504)."""

    error_type = "upstream_connection_error"


class EngineError(GymserveError):
    """The local engine failed while generating (500); a bug or resource problem, not bad input."""
