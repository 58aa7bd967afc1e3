"""Running the server: in the foreground (``gymserve serve``) or in a background thread (demo, tests).

The backend is built inside the event loop that serves it, so its HTTP clients and the engine's
queues belong to that loop; it is closed when the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

import uvicorn

log = logging.getLogger("gymserve.server")


def _server_key(config) -> str | None:
    key = getattr(config.server, "api_key", None)
    return key.get_secret_value() if hasattr(key, "get_secret_value") else key


def build_app(config, backend):
    """The FastAPI app for ``config`` (a ``GymserveConfig``) over an already built ``backend``."""
    from gymserve.server.app import create_app

    return create_app(backend, max_body_bytes=config.server.max_body_bytes, server_api_key=_server_key(config))


def _uvicorn_config(app, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=30, lifespan="off")


def _warn_exposed(config) -> None:
    if config.server.host not in ("127.0.0.1", "localhost", "::1") and not _server_key(config):
        log.warning("binding %s without a server API key: anyone who can reach this address can use the "
                    "model; set server.api_key (or --server-api-key-env NAME)", config.server.host)


async def serve_async(config, backend=None) -> None:
    """Build the backend (unless given), serve until SIGINT/SIGTERM, then close the backend."""
    from gymserve.backends import build_backend

    backend = backend or build_backend(config)
    _warn_exposed(config)
    server = uvicorn.Server(_uvicorn_config(build_app(config, backend), config.server.host, config.server.port))
    try:
        await server.serve()
    finally:
        await backend.close()


@dataclass
class BackgroundServer:
    """A server running in a daemon thread with its own event loop; ``base_url`` ends with ``/v1``."""

    base_url: str = ""
    backend: object = None
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _error: list = field(default_factory=list)

    def stop(self, timeout: float = 30) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_background_server(config, backend_factory=None, *, startup_timeout: float = 600) -> BackgroundServer:
    """Start a server for ``config`` in a thread and wait until it accepts connections.

    ``config.server.port`` 0 picks a free port. ``backend_factory()`` may supply the backend (tests);
    by default it is built from ``config.backend``. Raises the backend's start-up error, or
    ``TimeoutError`` after ``startup_timeout`` seconds.
    """
    bg = BackgroundServer()
    ready = threading.Event()

    async def main():
        try:
            if backend_factory is None:
                from gymserve.backends import build_backend

                backend = build_backend(config)
            else:
                backend = backend_factory()
        except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
            bg._error.append(exc)
            ready.set()
            return
        bg.backend = backend
        server = uvicorn.Server(_uvicorn_config(build_app(config, backend), config.server.host, config.server.port))
        server.install_signal_handlers = lambda: None  # only the main thread may own signals
        bg._server = server
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            bg.base_url = f"http://{config.server.host}:{port}/v1"
        ready.set()
        try:
            await task
        finally:
            await backend.close()

    def run():
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001
            bg._error.append(exc)
            ready.set()

    bg._thread = threading.Thread(target=run, name="gymserve-server", daemon=True)
    bg._thread.start()
    if not ready.wait(startup_timeout):
        raise TimeoutError(f"gymserve did not start within {startup_timeout} s")
    if bg._error:
        raise bg._error[0]
    if not bg.base_url:
        raise RuntimeError(f"gymserve could not bind {config.server.host}:{config.server.port}")
    return bg
