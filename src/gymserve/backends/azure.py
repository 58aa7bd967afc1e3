"""The azure backend: Azure OpenAI through ``AsyncAzureOpenAI``, either API.

Azure OpenAI REST behaviour followed (learn.microsoft.com, "Azure OpenAI in Azure AI Foundry
Models REST API reference" and "API version lifecycle"):

- **Chat Completions is deployment-scoped**:
  ``POST {endpoint}/openai/deployments/{deployment}/chat/completions?api-version=V``.
- **Responses is not**: ``POST {endpoint}/openai/responses?api-version=V`` (dated versions) or
  ``{endpoint}/openai/v1/responses`` (the v1 API, ``api_version: preview|latest``), with the
  deployment name in ``body.model``. The same deployment therefore has two different base URLs,
  and a ``/deployments/`` base used for Responses is answered with a bare 404.
- every request needs the ``api-version`` query parameter (a bare 404 "Resource not found"
  without it); the SDK adds it as a default query parameter. The key goes in the ``api-key``
  header, or an Entra ID token as ``Authorization: Bearer``.

``api: chat`` serves ``/v1/responses`` by converting to Chat Completions; ``api: responses`` passes
it to the Responses URL natively. Gateways set ``chat_base_url``/``responses_base_url``, to which
``/chat/completions``/``/responses`` are appended as is (case AZ-01). URLs are built here, once,
from ``AzureBackendConfig.chat_base``/``responses_base`` and sent absolute, so the SDK's own
deployment-path rewriting never applies (it would add ``/deployments/`` to a gateway's chat base).
"""

from __future__ import annotations

import os
from typing import Any

from gymserve.backends.remote import RemoteBackend
from gymserve.backends.upstream import Transport, Upstream, secret_value
from gymserve.errors import InvalidRequestError
from gymserve.redaction import redact_url


class AzureUpstream(Upstream):
    """``AzureBackendConfig``: one upstream, chat or Responses API (see the module docstring)."""

    kind = "azure"
    cloud = True

    @property
    def native_responses(self) -> bool:  # type: ignore[override]
        return self.config.api == "responses"

    def bases(self) -> list[str]:
        cfg = self.config
        return [cfg.responses_base if cfg.api == "responses" else cfg.chat_base]

    def target(self) -> str:
        cfg = self.config
        return f"chat {redact_url(cfg.chat_base)} | responses {redact_url(cfg.responses_base)} (api-version {cfg.api_version})"

    def transport(self, base: str) -> Transport:
        from openai import AsyncAzureOpenAI

        cfg = self.config
        token = secret_value(cfg.azure_ad_token)
        key = secret_value(cfg.api_key)
        if not (key or token):
            # A gateway may authenticate with default_headers alone; the SDK insists on a credential.
            key = os.environ.get("AZURE_OPENAI_API_KEY") or "none"
        return Transport(
            AsyncAzureOpenAI(
                base_url=base,
                api_version=cfg.api_version,
                api_key=None if token else key,
                azure_ad_token=token,
                **self._sdk_options(),
            )
        )

    def url(self, base: str, kind: str) -> str:
        cfg = self.config
        if kind in ("chat", "completions"):  # both deployment-scoped
            if cfg.chat_base_url is None and (cfg.resource_endpoint is None or cfg.deployment_name is None):
                raise InvalidRequestError(
                    "this Azure backend is configured for the Responses API only; set endpoint and deployment "
                    f"(or chat_base_url) to serve /v1/{'chat/completions' if kind == 'chat' else 'completions'}"
                )
            return f"{cfg.chat_base}/{'chat/completions' if kind == 'chat' else 'completions'}"
        if kind == "responses":
            if cfg.responses_base_url is None and cfg.endpoint is None:
                raise InvalidRequestError("set endpoint or responses_base_url to use the Azure Responses API")
            return f"{cfg.responses_base}/responses"
        # Model listing is resource-wide ({endpoint}/openai/models), never deployment-scoped.
        base = cfg.responses_base if (cfg.endpoint or cfg.responses_base_url) else cfg.chat_base
        return f"{base}/models"

    def model(self, request: dict[str, Any]) -> str | None:
        # Azure routes on the deployment name (the path for chat, body.model for Responses).
        return self.config.deployment_name or request.get("model")


class AzureBackend(RemoteBackend):
    """``RemoteBackend`` over an ``AzureUpstream``."""

    name = "azure"
    upstream_type = AzureUpstream
