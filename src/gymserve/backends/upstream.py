"""What a remote backend calls: an ``Upstream`` says where (URLs), as whom (credentials) and how
(HTTP clients, body rules) to reach one remote API; a ``Transport`` is the HTTP stack of one replica.

The three kinds of upstream (``chat.ChatUpstream``, ``openai_backend.OpenAIUpstream``,
``azure.AzureUpstream``) differ only in these facts; calling them (replica pool, limiter, retries,
error translation) is ``caller.UpstreamCaller``'s job and answering requests ``remote.RemoteBackend``'s,
once for all three.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from gymserve.backends.chat_wire import strip_training_fields
from gymserve.convert import ConvertOptions

PLACEHOLDER_KEY = "EMPTY"  # what vLLM's docs use; never let the SDK pick up OPENAI_API_KEY for a self-hosted server
_PATHS = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses", "models": "/models"}


def secret_value(secret: Any) -> str | None:
    """The plain value of a ``SecretStr`` config field (None stays None)."""
    return secret.get_secret_value() if secret is not None else None


@dataclass
class Transport:
    """One replica's HTTP stack. ``sdk``: the openai SDK client (``AsyncOpenAI`` /
    ``AsyncAzureOpenAI``: auth header, ``default_query``, ``default_headers``, timeouts; its own
    retries off), used for streams and GETs; ``lean``: an ``http.JSONClient`` for plain POSTs when
    the upstream has one (self-hosted chat servers: see ``http`` for the measured reason), else the
    SDK posts too."""

    sdk: Any
    lean: Any = None

    async def get(self, url: str, *, timeout: float | None = None) -> Any:
        return await self.sdk.get(url, cast_to=object, options={"timeout": timeout} if timeout else {})

    async def post(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> Any:
        """The parsed JSON answer to POST ``body``; ``headers`` are added to the client's own."""
        if self.lean is not None:
            return await self.lean.post(url, body, headers=headers)
        return await self.sdk.post(url, body=body, cast_to=object, options={"headers": headers} if headers else {})

    def stream_class(self) -> Any:
        """The SDK's stream class for ``sdk`` (the openai SDK's ``AsyncStream``)."""
        from openai import AsyncStream

        return AsyncStream

    async def stream(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> Any:
        """The SDK's ``AsyncStream`` of server-sent events, each parsed as JSON."""
        return await self.sdk.post(
            url,
            body=body,
            cast_to=object,
            stream=True,
            stream_cls=self.stream_class()[object],
            options={"headers": headers} if headers else {},
        )

    async def close(self) -> None:
        for client in (self.sdk, self.lean):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()


class Upstream(ABC):
    """One remote API as configured (``config``: a ``gymserve.config`` remote backend model).

    A kind of upstream states its facts as data where it can and implements ``bases`` and
    ``transport`` (and ``url``, ``model``, ``target`` where its rules differ from an
    OpenAI-compatible server's): ``kind`` names it in error hints
    (``upstream_errors.translate_error``); ``native_responses``: ``/v1/responses`` goes to its own
    Responses API instead of being converted to Chat Completions; ``cloud``: it rejects gymserve's
    training fields on messages and items, accepts the ``developer`` role and wants
    ``max_completion_tokens`` (OpenAI, Azure) — the defaults of ``convert_options``.
    """

    kind: ClassVar[str]
    cloud: ClassVar[bool] = False
    native_responses: bool = False

    def __init__(self, config: Any):
        self.config = config

    # ---- where ---------------------------------------------------------------------------------

    @abstractmethod
    def bases(self) -> list[str]:
        """The base URL of each replica (``/chat/completions`` etc. are appended to it)."""

    def url(self, base: str, kind: str) -> str:
        """The URL of ``kind`` (``chat``, ``completions``, ``responses``, ``models``) on the replica at ``base``;
        raises ``InvalidRequestError`` (400) for an API this upstream is not configured for."""
        return base + _PATHS[kind]

    def target(self) -> str:
        """What ``describe()`` and ``gymserve check`` name as the upstream (credentials removed)."""
        from gymserve.redaction import redact_url

        return ", ".join(redact_url(b) for b in self.bases())

    # ---- as whom, and how ----------------------------------------------------------------------

    @property
    def secrets(self) -> tuple[str, ...]:
        """The configured credentials, for redaction."""
        values = (secret_value(getattr(self.config, f, None)) for f in ("api_key", "azure_ad_token", "control_api_key"))
        return tuple(v for v in values if v)

    @property
    def api_version(self) -> str | None:
        return getattr(self.config, "api_version", None)

    @property
    def session_header(self) -> bool:
        """Whether calls carry the session ID upstream as ``X-Session-ID`` (``forward_session_id``;
        self-hosted servers and the routers in front of them use it, clouds have no use for it)."""
        return bool(getattr(self.config, "forward_session_id", False))

    @property
    def health_interval(self) -> float:
        """Seconds between replica probes (0: none)."""
        return float(getattr(self.config, "health_check_interval", 0) or 0)

    @abstractmethod
    def transport(self, base: str) -> Transport:
        """The HTTP stack for the replica at ``base``."""

    def _sdk_options(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "default_query": cfg.default_query or None,
            "default_headers": cfg.default_headers or None,
            "timeout": cfg.timeout,
            "max_retries": 0,
        }

    # ---- what is sent --------------------------------------------------------------------------

    def model(self, request: dict[str, Any]) -> str | None:
        """The upstream's model name for ``request`` (None: leave the request's)."""
        return self.config.model or request.get("model")

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat body as this upstream accepts it (a cloud's without training fields)."""
        return strip_training_fields(body) if self.cloud else body

    def responses_body(self, request: dict[str, Any]) -> dict[str, Any]:
        """A Responses request as sent to a native Responses API: ``extra_body`` under it,
        gymserve's training fields removed (clouds reject unknown fields), ``model`` replaced,
        ``stream`` and ``stream_options`` left to the caller."""
        body = strip_training_fields({**self.config.extra_body, **request})
        body.pop("stream", None)
        body.pop("stream_options", None)
        model = self.model(request)
        if model:
            body["model"] = model
        return body

    def convert_options(self) -> ConvertOptions:
        """How Responses requests are rendered as chat for this upstream: the config's choices, else
        ``system`` / ``max_tokens`` (self-hosted servers: HF templates reject ``developer``) or, for
        clouds, ``keep`` / ``max_completion_tokens`` (their reasoning models reject ``max_tokens``)."""
        cfg = self.config
        role: Literal["system", "keep"] = "keep" if self.cloud else "system"
        field: Literal["max_tokens", "max_completion_tokens"] = "max_completion_tokens" if self.cloud else "max_tokens"
        return ConvertOptions(
            reasoning_mode=cfg.reasoning_mode,
            developer_role=cfg.developer_role or role,
            max_tokens_field=cfg.max_tokens_field or field,
        )
