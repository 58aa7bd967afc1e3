"""Running the server: in the foreground (``gymserve serve``) or in a background thread (demo, tests).

The backend is built inside the event loop that serves it, so its HTTP clients and the engine's
queues belong to that loop; it is closed when the server stops.
"""

from __future__ import annotations

import asyncio
import gc
import contextlib
import logging
import signal
import sys
import threading
from dataclasses import dataclass, field

import uvicorn

log = logging.getLogger("gymserve.server")


def _server_key(config, field: str = "api_key") -> str | None:
    key = getattr(config.server, field, None)
    return key.get_secret_value() if key is not None and hasattr(key, "get_secret_value") else key


def run_event_loop(coro):
    """Run ``coro`` to completion on uvloop when it is installed (a faster event loop; uvicorn's
    own ``loop`` setting does not apply when we own the loop), else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def build_app(config, backend):
    """The FastAPI app for ``config`` (a ``GymserveConfig``) over an already built ``backend``."""
    from gymserve.server.app import create_app
    from gymserve.server.control import control_allowed

    keys = _server_key(config), _server_key(config, "admin_api_key")
    return create_app(backend, max_body_bytes=config.server.max_body_bytes, server_api_key=keys[0],
                      capture_path=config.server.capture_path, admin_api_key=keys[1],
                      control_allowed=control_allowed(config.server.host, *keys))


class GymserveServer(uvicorn.Server):
    """uvicorn's server, plus: the moment shutdown starts (SIGTERM/SIGINT or ``should_exit``), the
    app is marked draining, so a request that still reaches it (on a kept-alive connection) gets a
    503 ``shutting_down`` while in-flight ones finish (at most ``server.shutdown_timeout`` s)."""

    def handle_exit(self, sig, frame) -> None:
        self._drain()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self._drain()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, minus re-raising the signal once ``serve()`` returns: that would kill the
        process before ``serve_async`` closes the backend and flushes the capture file. After a
        graceful SIGTERM, ``gymserve serve`` cleans up and exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _drain(self) -> None:
        app = self.config.app
        state = getattr(app, "state", None)
        if state is not None and not getattr(state, "draining", False):
            state.draining = True
            log.info("shutting down: refusing new requests, waiting up to %g s for in-flight ones",
                     self.config.timeout_graceful_shutdown)


def _uvicorn_config(app, host: str, port: int, shutdown_timeout: float = 30.0) -> uvicorn.Config:
    # No proxy-header rewriting: nothing reads the client address, and it costs a layer per request.
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=shutdown_timeout, lifespan="off", proxy_headers=False)


def _server_for(config, app) -> GymserveServer:
    return GymserveServer(_uvicorn_config(app, config.server.host, config.server.port,
                                          getattr(config.server, "shutdown_timeout", 30.0)))


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _warn_exposed(config) -> None:
    """Warn (log and stderr) when binding beyond loopback without a server API key (the control
    routes are then closed: ``server.control.control_allowed``)."""
    if config.server.host not in _LOOPBACK and not _server_key(config):
        msg = (f"binding {config.server.host} without a server API key: anyone who can reach this address can use "
               "the model; set server.api_key (or --server-api-key-env NAME)")
        if not _server_key(config, "admin_api_key"):
            msg += "; the control routes (/pause, /update_weights, ...) answer 403 until a key is set"
        log.warning(msg)
        if not logging.getLogger().handlers:
            print(f"gymserve: warning: {msg}", file=sys.stderr)


async def serve_async(config, backend=None) -> None:
    """Build the backend (unless given), serve until SIGINT/SIGTERM, then close the backend."""
    from gymserve.backends import build_backend

    from gymserve.server.app import close_app

    backend = backend or build_backend(config)
    _warn_exposed(config)
    if hasattr(backend, "describe"):
        info = backend.describe()
        if info.get("tool_call_parser"):
            # `auto` must say what it chose (and why), as `vllm serve` users expect to see.
            print(f"gymserve: tool-call parser {info['tool_call_parser']} "
                  f"({info.get('tool_call_parser_reason') or 'configured'}); reasoning parser "
                  f"{info.get('reasoning_parser') or 'none'}", file=sys.stderr)
    app = build_app(config, backend)
    server = _server_for(config, app)
    # Start-up objects (model, tokenizer, schemas) never die: freezing them keeps the cyclic GC from
    # rescanning them on every collection that request churn triggers.
    gc.collect()
    gc.freeze()
    try:
        await server.serve()
    finally:
        try:
            await backend.close()
        finally:
            close_app(app)


@dataclass
class BackgroundServer:
    """A server running in a daemon thread with its own event loop; ``base_url`` ends with ``/v1``.
    ``loop`` is that event loop (run the backend's coroutines on it: ``asyncio.run_coroutine_threadsafe``)."""

    base_url: str = ""
    backend: object = None
    app: object = None
    loop: asyncio.AbstractEventLoop | None = None
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
        from gymserve.server.app import close_app

        bg.backend = backend
        bg.loop = asyncio.get_running_loop()
        app = build_app(config, backend)
        bg.app = app
        server = _server_for(config, app)
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
            try:
                await backend.close()
            finally:
                close_app(app)

    def run():
        try:
            run_event_loop(main())
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
