"""One exception hierarchy for everything a client can be told.

Every error carries the HTTP status and the fields of the OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``, as the OpenAI API returns them), so the server
turns any of them into a response without guessing. Messages say what was wrong and what to do.
The cause of a failure is its class; ``code`` is only what the client reads, never compared here::

    GymserveError                      500 server_error
    ├── InvalidRequestError            400 invalid_request_error   (code per case: invalid_json, ...)
    │   ├── ContextLengthExceededError 400 context_length_exceeded (local engine or upstream alike)
    │   ├── SpliceError                400 splice_failed
    │   ├── RequestTooLargeError       413 request_too_large
    │   ├── WeightUpdateError          400 invalid_weights        (nothing changed; the old weights serve)
    │   │   └── WeightTransferError    400 weight_transfer_failed (a process-group transfer broke off)
    │   └── NotFoundError              404 invalid_request_error   (e.g. a LoRA adapter not loaded)
    ├── NotSupportedError              501 not_supported_error     (e.g. weight updates on a remote backend)
    ├── ConflictError                  409 conflict_error          (e.g. a wait-pause past its deadline)
    ├── PermissionDeniedError          403 permission_error        (control routes closed on this bind)
    ├── OverloadedError                429 rate_limit_error        overloaded (a full queue here)
    │   └── UpstreamRateLimitedError   429 rate_limit_error        upstream_rate_limited   [retried]
    ├── ShuttingDownError              503 server_error            shutting_down
    ├── EngineError                    500 server_error            (the local engine failed)
    │   ├── EngineBuildError           500 server_error            engine_build  (llama.cpp with AMX kernels; at start-up)
    │   └── EngineDownError            503 server_error            engine_down   (the worker died: every call until restart)
    └── UpstreamError                  502 upstream_error          (a remote server, OpenAI, Azure, a replica)
        ├── UpstreamRejectedError      the upstream's 4xx, invalid_request_error (passed on as it said)
        ├── UpstreamNotFoundError      502 upstream_not_found
        ├── UpstreamAuthError          502 upstream_auth
        ├── UpstreamServerError        502 upstream_server_error   [retried]
        ├── UpstreamBadResponseError   502 upstream_bad_response
        ├── UpstreamTokenIdsError      502 upstream_token_ids
        ├── UpstreamStreamIncompleteError 502 stream_incomplete    (a stream ended without its terminal event)
        └── UpstreamConnectionError    502 upstream_connection_error
            ├── UpstreamUnreachableError 502 upstream_unreachable  [retried; the replica is marked down]
            ├── NoReplicaError         502 no_replica              (every replica excluded or filtered out)
            └── UpstreamTimeoutError     504 upstream_timeout      (never retried: it may still run)

``retryable`` (a class attribute) is what the remote backends' caller retries. Errors cross process
boundaries (Ray replicas) by pickling with every field (:meth:`GymserveError.__reduce__`).
"""

from __future__ import annotations

from typing import Any, ClassVar


class GymserveError(Exception):
    """Base class. ``status_code`` is the HTTP status; ``error_type``/``param``/``code`` fill the
    error object (``code`` defaults to the class's)."""

    status_code: int = 500
    error_type: ClassVar[str] = "server_error"
    code: str | None = None
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else type(self).code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def __reduce__(self):
        # Subclasses take different constructor arguments; the instance state alone describes each.
        return _rebuild, (type(self), self.message), self.__dict__


def _rebuild(cls: type[GymserveError], message: str) -> GymserveError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    return exc


class InvalidRequestError(GymserveError):
    """The request is malformed or asks for something this server cannot do (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt leaves no room in the context window (400, code ``context_length_exceeded``).

    Raised by the local engine (``prompt_tokens``, ``context_window``: the message always contains
    the words "context length" and both counts, which is what NeMo Gym and vLLM clients match on to
    end a rollout cleanly instead of retrying) and by remote backends for an upstream overflow
    (``message``: the upstream's words, ``url``: where; the counts are then None). Never retried:
    the overflow is deterministic. The Responses path answers it with an empty ``incomplete``
    Response (case CL-01).
    """

    code = "context_length_exceeded"

    def __init__(
        self,
        prompt_tokens: int | None,
        context_window: int | None,
        *,
        message: str | None = None,
        url: str | None = None,
        param: str | None = "messages",
    ):
        super().__init__(
            message
            or f"This model's maximum context length is {context_window} tokens, but the prompt has "
            f"{prompt_tokens} tokens, leaving no room to generate. Shorten the conversation.",
            param=param,
        )
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window
        self.url = url


class SpliceError(InvalidRequestError):
    """The on-policy prefix splice could not find an unambiguous turn boundary (400, ``splice_failed``)."""

    code = "splice_failed"

    def __init__(self, message: str):
        super().__init__(message, param="messages")


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than ``server.max_body_bytes`` (413)."""

    status_code = 413
    code = "request_too_large"

    def __init__(self, size: int | str, limit: int):
        super().__init__(f"request body is {size} bytes; the limit is {limit} (server.max_body_bytes)")


class WeightUpdateError(InvalidRequestError):
    """A weight update was refused before anything changed (400, code ``invalid_weights``): an
    unknown tensor name, a wrong shape or dtype, NaN/inf values, an unreadable file. ``param`` names
    the tensor or file; the old weights keep serving."""

    code = "invalid_weights"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param)


class WeightTransferError(WeightUpdateError):
    """A process-group weight transfer failed before anything changed (400, code
    ``weight_transfer_failed``): the trainer's rendezvous or a broadcast did not complete (the trainer
    died, the connection dropped, the group's timeout passed). The old weights keep serving; the
    group is closed (``engine.weight_transfer``)."""

    code = "weight_transfer_failed"


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
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class UpstreamRateLimitedError(OverloadedError):
    """The upstream answered 429. ``upstream_retry_after``: its ``Retry-After`` in seconds (None
    when it sent none; ``retry_after`` is then 1 s). Retried with backoff."""

    code = "upstream_rate_limited"
    retryable = True

    def __init__(self, message: str, *, upstream_retry_after: float | None = None):
        super().__init__(message, retry_after=upstream_retry_after or 1.0)
        self.upstream_retry_after = upstream_retry_after


class ShuttingDownError(GymserveError):
    """The server is draining for shutdown and takes no new calls (503, ``Retry-After``)."""

    status_code = 503
    code = "shutting_down"

    def __init__(self) -> None:
        super().__init__(
            "gymserve is shutting down and accepts no new requests; retry against another instance or after it restarts"
        )
        self.retry_after = 1.0


class EngineError(GymserveError):
    """The local engine failed while generating (500); a bug or resource problem, not bad input."""


class EngineBuildError(EngineError):
    """The linked engine library was built in a way gymserve refuses to run (raised at start-up, before
    any model call): llama.cpp with AMX kernels, which crash in the first ``llama_decode`` on current
    Xeons (ggml-org/llama.cpp#20824). The message names the cause, the rebuild command and the
    environment variable that overrides the refusal."""

    code = "engine_build"


class EngineDownError(EngineError):
    """The in-process engine stopped working (503, ``Retry-After`` absent: it does not come back by
    itself): its worker thread died on an exception (vLLM: its engine core died). Every call in flight and every later call gets
    this error; ``/health`` reports ``down`` with the same ``reason``. ``engine``: the engine's name
    (``llamacpp``, ``transformers``); ``reason``: the exception, ``"OverflowError: ..."``."""

    status_code = 503
    code = "engine_down"

    def __init__(self, engine: str, reason: str):
        super().__init__(
            f"the {engine} engine is down: it stopped on {reason}; every call fails until gymserve "
            "is restarted (the traceback is in the server log)"
        )
        self.engine = engine
        self.reason = reason


class UpstreamError(GymserveError):
    """The backend (a remote chat server, OpenAI, Azure, a Ray replica) failed (502 unless
    ``status_code`` says otherwise).

    ``url`` is the URL tried (never with credentials); messages name the URL, the cause and the fix.
    """

    status_code = 502
    error_type = "upstream_error"

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        status_code: int | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.url = url
        if status_code is not None:
            self.status_code = status_code


class UpstreamRejectedError(UpstreamError):
    """The upstream refused this request with a 4xx (an unsupported parameter, a bad tool schema):
    passed on with its status (408 becomes 504), message, ``param`` and ``code``."""

    error_type = "invalid_request_error"


class UpstreamNotFoundError(UpstreamError):
    """The upstream answered 404: a wrong path, model, deployment or api-version."""

    code = "upstream_not_found"


class UpstreamAuthError(UpstreamError):
    """The upstream rejected the credentials (401/403)."""

    code = "upstream_auth"


class UpstreamServerError(UpstreamError):
    """The upstream failed with a 5xx; retried."""

    code = "upstream_server_error"
    retryable = True


class UpstreamBadResponseError(UpstreamError):
    """The upstream answered with something that is not the expected JSON or event stream."""

    code = "upstream_bad_response"


class UpstreamTokenIdsError(UpstreamError):
    """With ``return_token_id_information``, the upstream's token metadata is missing or inconsistent."""

    code = "upstream_token_ids"


class UpstreamStreamIncompleteError(UpstreamError):
    """The upstream's event stream ended without its API's terminal event (a chat or completions
    choice without a ``finish_reason``, a Responses stream without ``response.completed`` /
    ``.incomplete`` / ``.failed``, a Messages stream without ``message_stop``): the answer was cut
    short (a crashed or restarted server, a proxy that closed the stream), so it must never look
    finished. 502: the call may succeed when sent again."""

    code = "stream_incomplete"


class UpstreamConnectionError(UpstreamError):
    """The backend could not be reached or did not answer (DNS, refused, TLS, timeout, a dead replica)."""

    error_type = "upstream_connection_error"


class UpstreamUnreachableError(UpstreamConnectionError):
    """No connection could be made (DNS, refused, TLS, reset): the replica is marked unhealthy and the
    call retried, on another replica when there is one."""

    code = "upstream_unreachable"
    retryable = True


class NoReplicaError(UpstreamConnectionError):
    """No replica of the pool can take the call: every one is excluded (it already failed this call)
    or refused by a routing filter (loading new weights, not serving the call's weight version)."""

    code = "no_replica"


class UpstreamTimeoutError(UpstreamConnectionError):
    """The upstream did not answer within the timeout (504); not retried, since it may still be running."""

    status_code = 504
    code = "upstream_timeout"
