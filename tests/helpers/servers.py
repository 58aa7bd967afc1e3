"""A gymserve started in front of an upstream for one test: ``with gateway(backend) as srv``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def gateway(backend: dict[str, Any]) -> Iterator[Any]:
    """A background gymserve on 127.0.0.1 with the ``backend`` section given (e.g. ``{"type": "chat",
    "base_urls": [...]}``), stopped when the block ends."""
    from gymserve.config import validate_config
    from gymserve.server.run import start_background_server

    srv = start_background_server(validate_config({"server": {"port": 0}, "backend": backend}))
    try:
        yield srv
    finally:
        srv.stop()
