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
