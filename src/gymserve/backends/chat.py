"""The chat backend: any OpenAI-compatible Chat Completions server, one or more replicas.

Serves vLLM, SGLang, TensorRT-LLM, llama.cpp, ``transformers serve`` or another gymserve
(``ChatBackendConfig``); what it does with answers is ``remote.RemoteBackend``'s. The upstream's
facts: ``base_urls`` are the replicas (probed every ``health_check_interval`` s when there are
several); the key travels as ``Authorization: Bearer`` and, when none is configured, the
placeholder ``EMPTY`` (vLLM's docs' value) rather than the SDK's ``OPENAI_API_KEY``, which belongs
to another service; plain POSTs go through the lean aiohttp client (``http``), streams and GETs
through the official SDK; ``/v1/responses`` is converted to Chat Completions. As a training
gateway it pauses the rollouts' calls at its door and forwards weight updates to the servers'
own control endpoints (``chat_control``).
"""

from __future__ import annotations

from typing import Any

from gymserve.backends.chat_control import ChatControl
from gymserve.backends.chat_versions import root_of
from gymserve.backends.remote import RemoteBackend
from gymserve.backends.upstream import PLACEHOLDER_KEY, Transport, Upstream, secret_value


class ChatUpstream(Upstream):
    """A self-hosted OpenAI-compatible chat server (see the module docstring)."""

    kind = "chat"

    def bases(self) -> list[str]:
        return list(self.config.base_urls)

    def transport(self, base: str) -> Transport:
        from openai import AsyncOpenAI

        from gymserve.backends.http import JSONClient

        cfg = self.config
        key = secret_value(cfg.api_key) or PLACEHOLDER_KEY
        lean = JSONClient(
            headers={"Authorization": f"Bearer {key}", **(cfg.default_headers or {})},
            params=cfg.default_query,
            limit=cfg.num_concurrent_requests,
            timeout=cfg.timeout,
        )
        return Transport(AsyncOpenAI(base_url=base, api_key=key, **self._sdk_options()), lean)


class ChatBackend(RemoteBackend):
    """``RemoteBackend`` over a ``ChatUpstream``, holding the training gateway's control
    (``chat_control.ChatControl``: pause at the door, forwarding to the servers' control
    endpoints); its gate and versions are the ones ``RemoteBackend`` admits and stamps calls with."""

    name = "chat"
    upstream_type = ChatUpstream
    control: ChatControl

    def __init__(self, upstream: Upstream, *, max_queue: int = 1024):
        super().__init__(upstream, max_queue=max_queue)
        self.control = ChatControl(upstream.config, max_queue)
        self.gate, self.versions = self.control.gate, self.control.versions
        # A replica back from being unhealthy may have restarted on other weights: read its version again.
        versions = self.versions
        if versions is not None:
            self.pool.on_recover.append(lambda replica: versions.forget(root_of(replica.base_url)))

    async def health(self) -> dict[str, Any]:
        """The replicas' health (``RemoteBackend.health``), after reading their weight versions."""
        await self.control.refresh()
        return await super().health()

    async def close(self) -> None:
        await self.control.close()
        await super().close()
