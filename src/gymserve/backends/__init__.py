"""Backends: one class per kind of upstream, chosen by ``backend.type`` in the config.

``BACKENDS`` (``gymserve.registry``) names every kind; the config validates ``backend.type`` by
it and the CLI's ``--backend`` choices and error messages read ``BACKENDS.names()``. Each entry is
imported on first use, so a local-only install never imports the openai SDK, a remote-only install
never imports torch, and nothing imports Ray until a ray backend is built. A new backend is one
module with a ``Backend`` subclass that has ``from_config(config, *, max_queue)``, its config model
in ``gymserve.config``, and one ``BACKENDS.register`` line in ``gymserve/registry.py``.
"""

from __future__ import annotations

from typing import Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.registry import BACKENDS, UnknownNameError

__all__ = ["BACKENDS", "Backend", "RequestContext", "build_backend"]


def build_backend(config: Any, *, max_queue: int | None = None) -> Backend:
    """The backend for ``config``: a ``GymserveConfig`` (its ``backend`` section, and
    ``server.max_queue`` as the queue bound) or one backend config model (its ``type`` names the
    ``BACKENDS`` entry).

    Raises ``ConfigError`` naming the choices for an unknown backend type or a
    ``tool_call_parser``/``reasoning_parser`` that names no registered parser; whatever the backend's
    ``from_config`` raises otherwise (``ImportError`` naming the package to install, start-up errors).
    """
    from gymserve.config import ConfigError, GymserveConfig

    if isinstance(config, GymserveConfig):
        max_queue = config.server.max_queue if max_queue is None else max_queue
        config = config.backend
    max_queue = 1024 if max_queue is None else max_queue
    try:
        return BACKENDS.get(config.type).from_config(config, max_queue=max_queue)
    except UnknownNameError as exc:  # a backend type, engine or parser name no registry has
        raise ConfigError(f"backend: {exc}") from None
