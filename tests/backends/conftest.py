"""Fixtures of the backend tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def servers():
    """``start(handler)``: a ``helpers.fakes.FakeServer`` on 127.0.0.1 for ``handler``, stopped after the test."""
    from helpers.fakes import FakeServer

    started: list[FakeServer] = []

    def start(handler):
        server = FakeServer(handler).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def gateway():
    """``gateway(upstream, flavour, **backend)`` → ``(BackgroundServer, FakeServer | None)``: a gymserve
    chat backend on 127.0.0.1 (``upstream_control: flavour``) before ``upstream`` — a
    ``helpers.fakes.FakeServer`` handler, started here, or the ``/v1`` base URL of a running server;
    ``backend`` overrides the backend section. Stopped after the test."""
    from gymserve.config import validate_config
    from gymserve.server.run import start_background_server
    from helpers.fakes import FakeServer

    started = []

    def make(upstream, flavour="none", *, max_queue=64, **backend):
        fake = FakeServer(upstream).start() if callable(upstream) else None
        cfg = validate_config(
            {
                "server": {"port": 0, "max_queue": max_queue},
                "backend": {
                    "type": "chat",
                    "base_urls": [fake.url + "/v1" if fake is not None else upstream],
                    "model": "policy",
                    "upstream_control": flavour,
                    "health_check_interval": 0,
                    "pause_timeout": 30,
                    **backend,
                },
            }
        )
        srv = start_background_server(cfg)
        started.append((srv, fake))
        return srv, fake

    yield make
    for srv, fake in started:
        srv.stop()
        if fake is not None:
            fake.stop()
