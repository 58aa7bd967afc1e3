"""Turning openai-SDK / httpx exceptions into gymserve errors that explain.

The SDK's ``APIConnectionError`` always reads "Connection error." and hides the cause (a missing
URL scheme, a DNS failure, a refused port), so misconfigured endpoints look like network outages
(case AZ-02). Here every failure becomes a ``GymserveError`` whose message names:

- the URL tried (``redaction.redact_url``: no user-info, no key-like query parameters);
- the cause: the HTTP status and upstream message, or the root exception class and host;
- the likely fix (missing ``/v1``, missing ``api-version``, a deployment-scoped Azure base used for
  Responses, a chat-only server asked for Responses, a wrong port...).

Each cause is its own class (``gymserve.errors``: ``UpstreamTimeoutError``,
``UpstreamUnreachableError``, ``UpstreamRateLimitedError``...), so callers decide by class. A 404 is
reported as a 404 with its path, never as a connection error. Upstream context-window overflows
become ``ContextLengthExceededError``, the class the local engine raises, so callers can answer with
an empty, incomplete reply instead of retrying (case CL-01). API keys never appear: every message
goes through ``redaction.redact`` with the configured secrets.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from gymserve.errors import (
    ContextLengthExceededError,
    GymserveError,
    UpstreamAuthError,
    UpstreamBadResponseError,
    UpstreamError,
    UpstreamNotFoundError,
    UpstreamRateLimitedError,
    UpstreamRejectedError,
    UpstreamServerError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gymserve.redaction import redact, redact_url

# What vLLM, SGLang, llama.cpp, TensorRT-LLM, OpenAI and Azure say when the prompt outgrows the window.
_CONTEXT_PATTERNS = re.compile(
    r"maximum context length|context length|context_length_exceeded|context window|exceed_context_size"
    r"|context size|max_model_len|maximum model length|max_seq_len|prompt is too long"
    r"|max_tokens.{0,40}(too large|exceed)|(too large|exceed).{0,40}max_tokens",
    re.I,
)


def is_context_length_message(text: str | None, code: str | None = None) -> bool:
    """True when an upstream error message/code means "the prompt does not fit the context window"."""
    return code == "context_length_exceeded" or bool(text and _CONTEXT_PATTERNS.search(text))


def _body_message(body: Any, fallback: str) -> tuple[str, str | None, str | None]:
    """(message, code, param) from an OpenAI-shaped (``{"error": {...}}``), vLLM-shaped
    (``{"object": "error", "message"}``) or FastAPI-shaped (``{"detail"}``) error body."""
    if isinstance(body, dict):
        err = body.get("error")
        inner = err if isinstance(err, dict) else body
        msg = inner.get("message") or inner.get("detail") or body.get("detail") or fallback
        code, param = inner.get("code"), inner.get("param")
        return str(msg), (str(code) if code is not None else None), (str(param) if param is not None else None)
    if isinstance(body, str) and body.strip():
        return body.strip()[:500], None, None
    return fallback, None, None


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _not_found_hint(url: str, kind: str, backend: str, api_version: str | None) -> str:
    path = urlsplit(url).path
    if backend == "anthropic":
        return (
            "base_url must be the server root (https://api.anthropic.com, or http://host:port for a server that "
            "speaks the Messages API); gymserve appends /v1/messages. Check the model name too."
        )
    if backend == "azure":
        hint = (
            "Azure answers a bare 404 'Resource not found' when api-version is missing or wrong, or the path is wrong. "
            "Chat Completions is deployment-scoped ({endpoint}/openai/deployments/<deployment>/chat/completions) "
            "but Responses is not ({endpoint}/openai/responses, or {endpoint}/openai/v1/responses): "
            "a /deployments/ base used for Responses 404s, and the deployment name goes in body.model."
        )
        if "/deployments/" in path and kind == "responses":
            hint = "This Responses URL is deployment-scoped, which Azure does not serve. " + hint
        return hint + f" api-version sent: {api_version or 'none'}; check the deployment name and api_version."
    if kind == "responses":
        return (
            "The server has no Responses API at this path: most OpenAI-compatible servers (vLLM, SGLang, llama.cpp, "
            "transformers serve) speak only Chat Completions; use backend type 'chat', which converts Responses "
            "requests to Chat Completions, or fix base_url."
        )
    if kind in ("tokenize", "detokenize"):
        return (
            f"The server has no /{kind} beside its /v1 (vLLM and SGLang serve one; transformers serve and the "
            "clouds do not): set backend.tokenizer to a tokenizer directory so gymserve answers it itself."
        )
    if kind == "completions":
        return "The server serves no /completions (legacy Completions API) here: use /v1/chat/completions."
    if "/v1" not in path:
        return "The base URL probably lacks /v1 (e.g. http://host:8000/v1); gymserve appends /chat/completions to it."
    return (
        "Check the base URL's path (it should end where /chat/completions is appended, usually /v1) and the model name."
    )


def _connection_hint(root: BaseException, host: str, port: int | None) -> str:
    text = f"{type(root).__name__}: {root}".lower()
    if (
        "name or service not known" in text
        or "nodename nor servname" in text
        or "getaddrinfo" in text
        or "name resolution" in text
        or "no address associated" in text
    ):
        return f"DNS lookup of {host} failed: check the host name in the base URL/endpoint."
    if "refused" in text:
        return f"nothing is listening on {host}:{port}: is the server running, and is the port right?"
    if "ssl" in text or "certificate" in text or "tls" in text:
        return "TLS handshake failed: check http:// vs https:// and the server's certificate."
    # Not any "protocol": a RemoteProtocolError (a server closing mid-answer) is not a URL problem.
    if "unsupportedprotocol" in text or "missing an 'http://' or 'https://'" in text or "unsupported protocol" in text:
        return "the URL must start with http:// or https://."
    if "timeout" in text:
        return "the server did not answer in time: raise timeout, lower the load, or check the host is reachable."
    return "check the base URL, that the server is up, and any proxy settings."


def translate_error(
    exc: BaseException,
    *,
    url: str,
    kind: str = "chat",
    backend: str = "chat",
    secrets: tuple[str, ...] = (),
    api_version: str | None = None,
    timeout: float | None = None,
) -> GymserveError:
    """The ``GymserveError`` that explains ``exc`` raised while calling ``url``.

    ``kind``: what was called ("chat", "responses", "messages", "models", "tokenize"); ``backend``:
    "chat", "openai", "azure" or "anthropic" (selects the hints). Returns (never raises) one of the ``gymserve.errors``
    classes: ``ContextLengthExceededError`` (400), ``UpstreamRejectedError`` with the upstream's 4xx
    status and message for other 4xx, ``UpstreamRateLimitedError`` (429, ``retry_after`` from the
    header), ``UpstreamNotFoundError`` / ``UpstreamAuthError`` / ``UpstreamServerError`` (502),
    ``UpstreamBadResponseError`` (502) for unreadable answers, ``UpstreamUnreachableError`` (502) and
    ``UpstreamTimeoutError`` (504); a ``GymserveError`` is returned as it is.
    """
    if isinstance(exc, GymserveError):
        return exc
    shown = redact_url(url)
    response = getattr(exc, "response", None)
    status = getattr(exc, "status_code", None) or getattr(response, "status_code", None)
    if status is not None and response is not None:
        body = getattr(exc, "body", None)
        if body is None:
            try:
                body = response.json()
            except Exception:
                body = getattr(response, "text", "")
        msg, code, param = _body_message(body, str(exc))
        msg = redact(msg, secrets)
        sent = getattr(response, "request", None)
        if sent is not None and getattr(sent, "url", None) is not None:
            shown = redact_url(str(sent.url))  # the URL as sent, default query (api-version) included
        where = f"{getattr(sent, 'method', 'POST')} {shown}"
        if status in (400, 413, 422, 500) and is_context_length_message(msg, code):
            return ContextLengthExceededError(
                None, None, message=f"upstream context window exceeded ({where}): {msg}", url=shown, param=None
            )
        if status == 404:
            return UpstreamNotFoundError(
                f"upstream returned 404 Not Found for {where}: {msg!r}. "
                f"{_not_found_hint(url, kind, backend, api_version)}",
                url=shown,
            )
        if status in (401, 403):
            fix = {
                "azure": "the key goes in the api-key header (api_key) or an Entra token in azure_ad_token",
                "anthropic": "set api_key or ANTHROPIC_API_KEY (sent as x-api-key)",
            }.get(backend, "set api_key (sent as Authorization: Bearer)")
            return UpstreamAuthError(
                f"upstream rejected the credentials ({status}) for {where}: {msg}. Check the key: {fix}.", url=shown
            )
        if status == 429:
            return UpstreamRateLimitedError(
                f"upstream is rate limiting ({where}): {msg}", upstream_retry_after=_retry_after(response)
            )
        if status < 400:  # an error event inside a 200 stream (Anthropic's `event: error`)
            return UpstreamError(f"upstream failed mid-stream ({where}): {msg}", url=shown, code="upstream_error")
        if 400 <= status < 500:
            return UpstreamRejectedError(
                msg, url=shown, status_code=status if status != 408 else 504, param=param, code=code
            )
        return UpstreamServerError(f"upstream failed with {status} ({where}): {msg}", url=shown)

    chain = _chain(exc)
    names = {type(e).__name__ for e in chain}
    root = _root_cause(exc)
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = parts.port or (443 if parts.scheme == "https" else 80 if parts.scheme == "http" else None)
    cause = f"{type(root).__name__}: {redact(str(root), secrets)}" if str(root) else type(root).__name__
    # The transport's class (httpx ConnectError, ReadTimeout...) is what users search for; the
    # root (gaierror, ConnectionRefusedError) says why.
    transport = next(
        (e for e in chain if type(e).__module__.split(".")[0].startswith(("httpx", "httpcore", "aiohttp"))), None
    )
    if transport is not None and transport is not root:
        cause = f"{type(transport).__name__} ({cause})"
    if names & {
        "APITimeoutError",
        "ReadTimeout",
        "WriteTimeout",
        "PoolTimeout",
        "TimeoutException",
        "TimeoutError",
    } and not names & {"ConnectTimeout"}:
        after = f" after {timeout:g} s" if timeout else ""
        return UpstreamTimeoutError(
            f"upstream {host} timed out{after} ({shown}; {cause}). "
            "Raise the backend timeout or lower num_concurrent_requests.",
            url=shown,
        )
    if names & {
        "APIConnectionError",
        "ConnectError",
        "ConnectTimeout",
        "NetworkError",
        "TransportError",
        "UnsupportedProtocol",
        "RemoteProtocolError",
        "ProxyError",
        "ReadError",
        "WriteError",
        "OSError",
        "ConnectionError",
        "gaierror",
        "LocalProtocolError",
        # aiohttp (the chat backend's lean client, backends/http.py)
        "ClientConnectionError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ServerConnectionError",
    } or isinstance(root, OSError):
        return UpstreamUnreachableError(
            f"cannot reach upstream host {host} ({shown}): {cause}. {_connection_hint(root, host, port)}", url=shown
        )
    if names & {"JSONDecodeError", "APIResponseValidationError"}:
        return UpstreamBadResponseError(
            f"upstream answered {shown} with something that is not the expected JSON "
            f"({cause}); is the base URL pointing at an OpenAI-compatible API?",
            url=shown,
        )
    return UpstreamError(f"calling {shown} failed: {cause}", url=shown)


def _retry_after(response: Any) -> float | None:
    try:
        return max(0.0, float(response.headers.get("retry-after")))
    except (TypeError, ValueError):
        return None


def is_retryable(err: GymserveError) -> bool:
    """The caller's retry rule: the error's class says (``GymserveError.retryable``). Unreachable
    replicas, 5xx and 429 are retried; a timeout (the request may still be running upstream), a 4xx
    and a context-window overflow (deterministic) are not."""
    return err.retryable
