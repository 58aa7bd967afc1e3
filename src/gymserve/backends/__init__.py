"""Backends: one class per kind of upstream, chosen by ``backend.type`` in the config.

``build_backend(config)`` is the only constructor the server needs; the remote backends (chat,
openai, azure) are imported lazily so a local-only install never imports the openai SDK, and the
local backend lazily so a remote-only install never imports torch.
"""

from __future__ import annotations

from typing import Any

from gymserve.backends.base import Backend, RequestContext

__all__ = ["Backend", "RequestContext", "build_backend"]


def build_backend(config: Any, *, max_queue: int | None = None) -> Backend:
    """The backend for ``config``: a ``GymserveConfig`` (its ``backend`` section, and
    ``server.max_queue`` as the queue bound) or one backend config model.

    Raises ``ValueError`` for an unknown backend type and ``ConfigError`` for a chat backend whose
    ``tool_parser``/``reasoning_parser`` names no registered parser.
    """
    from gymserve.config import (
        AzureBackendConfig, ChatBackendConfig, ConfigError, GymserveConfig, LocalBackendConfig, OpenAIBackendConfig,
    )

    if isinstance(config, GymserveConfig):
        max_queue = config.server.max_queue if max_queue is None else max_queue
        config = config.backend
    max_queue = 1024 if max_queue is None else max_queue
    if isinstance(config, LocalBackendConfig):
        # ---- local backend: owned by the lead (gymserve.backends.local) -------------------------
        from gymserve.backends.local import LocalBackend

        return LocalBackend.from_config(config, max_queue=max_queue)
    from gymserve.config import RayBackendConfig

    if isinstance(config, RayBackendConfig):
        # ---- ray backend: N local-engine replicas as Ray actors (gymserve.ray_cluster) ------------
        from gymserve.ray_cluster.backend import RayBackend

        return RayBackend(config, max_queue=max_queue)
    try:
        if isinstance(config, AzureBackendConfig):
            from gymserve.backends.azure import AzureBackend

            return AzureBackend(config, max_queue=max_queue)
        if isinstance(config, OpenAIBackendConfig):
            from gymserve.backends.openai_backend import OpenAIBackend

            return OpenAIBackend(config, max_queue=max_queue)
        if isinstance(config, ChatBackendConfig):
            from gymserve.backends.chat import ChatBackend

            return ChatBackend(config, max_queue=max_queue)
    except ValueError as exc:  # unknown parser names
        raise ConfigError(f"backend: {exc}") from None
    raise ValueError(f"unknown backend config {type(config).__name__}")
