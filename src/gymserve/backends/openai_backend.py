"""The openai backend: a Responses-native API (OpenAI itself, or any server that speaks Responses).

``/v1/responses`` is passed to ``{base_url}/responses`` as is, with ``model`` replaced by the
configured one; ``/v1/chat/completions`` goes to ``{base_url}/chat/completions``. gymserve's
training fields are stripped from the history first: the OpenAI API rejects unknown fields on
input items and messages. The key travels as ``Authorization: Bearer`` (``AsyncOpenAI``; with no
``api_key`` configured the SDK reads ``OPENAI_API_KEY``, as every OpenAI client does). Limits,
retries, error translation and context-overflow handling are ``remote.RemoteBackend``'s.
"""

from __future__ import annotations

from gymserve.backends.remote import RemoteBackend
from gymserve.backends.upstream import Transport, Upstream, secret_value


class OpenAIUpstream(Upstream):
    """``OpenAIBackendConfig``: one base URL, the SDK for every call, Responses passed through."""

    kind = "openai"
    cloud = True
    native_responses = True

    def bases(self) -> list[str]:
        return [self.config.base_url]

    def transport(self, base: str) -> Transport:
        from openai import AsyncOpenAI

        return Transport(AsyncOpenAI(base_url=base, api_key=secret_value(self.config.api_key), **self._sdk_options()))


class OpenAIBackend(RemoteBackend):
    """``RemoteBackend`` over an ``OpenAIUpstream``."""

    name = "openai"
    upstream_type = OpenAIUpstream
