"""Running the server: in the foreground (``gymserve serve``) or in a background thread (demo, tests).

The backend is built inside the event loop that serves it, so its HTTP clients and the engine's
queues belong to that loop; it is closed when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
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
    """The FastAPI app for ``config`` (a ``GymserveConfig``) over an already built ``backend``;
    ``/v1/models`` lists ``config.served_model_names`` when set, else what the backend names."""
    from gymserve.server.app import create_app
    from gymserve.server.control_routes import control_allowed

    keys = _server_key(config), _server_key(config, "admin_api_key")
    return create_app(
        backend,
        max_body_bytes=config.server.max_body_bytes,
        server_api_key=keys[0],
        capture_path=config.server.capture_path,
        admin_api_key=keys[1],
        control_allowed=control_allowed(config.server.host, *keys),
        served_models=getattr(config, "served_model_names", None) or None,
        tokens_as_ids=config.server.return_tokens_as_token_ids,
    )


class BindError(OSError):
    """The server could not listen on ``host:port``; the message names ``--port``/``--host`` and the fix.

    An ``OSError`` whose ``errno`` is the cause's (``EADDRINUSE``, ``EACCES``, ``EADDRNOTAVAIL``, ...);
    ``str()`` is the message alone, without uvicorn's bare ``[Errno 98]``.
    """

    def __init__(self, host: str, port: int, cause: OSError):
        self.host, self.port = host, port
        where = f"{host}:{port}"
        if cause.errno == errno.EADDRINUSE:
            message = (
                f"cannot listen on {where}: port {port} is already in use by another process (find it with "
                f"`ss -ltnp 'sport = :{port}'` or `lsof -i :{port}`); stop it, or pass another --port "
                f"(server.port in the config; --port 0 picks a free one)"
            )
        elif cause.errno == errno.EACCES:
            message = (
                f"cannot listen on {where}: permission denied (ports below 1024 need root); pass "
                f"--port 1024 or higher (server.port in the config)"
            )
        elif isinstance(cause, socket.gaierror) or cause.errno == errno.EADDRNOTAVAIL:
            message = (
                f"cannot listen on {where}: {host!r} is not an address of this machine "
                f"({cause.strerror or cause}); pass --host 127.0.0.1 (loopback) or 0.0.0.0 (every interface)"
            )
        else:
            message = f"cannot listen on {where}: {cause.strerror or cause}; check --host and --port"
        super().__init__(cause.errno, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _addresses(host: str, port: int) -> list[tuple[int, tuple]]:
    """``[(family, sockaddr)]`` for ``host``. An IP literal (the usual 127.0.0.1, 0.0.0.0, ::) is
    read without ``getaddrinfo``: a lookup in this process before Ray starts made a restarting Ray
    replica fail calls instead of queueing them (tests/backends/test_ray.py's killed-replica test)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise BindError(host, port, exc) from exc
        return list(dict.fromkeys((fam, addr) for fam, _, _, _, addr in infos))
    if ip.version == 6:
        return [(socket.AF_INET6, (host, port, 0, 0))]
    return [(socket.AF_INET, (host, port))]


def check_port(host: str, port: int) -> None:
    """Raise ``BindError`` now when ``host:port`` cannot be bound, so a clash fails in a second,
    before a model loads, not after. Binds (as asyncio's ``create_server`` does: ``SO_REUSEADDR``,
    IPv6 sockets IPv6-only) and closes at once; uvicorn binds for real once the backend is up.
    Port 0 is not checked: any free port will do."""
    if port == 0:
        return
    for family, addr in _addresses(host, port):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise BindError(host, port, exc) from exc


def base_url_of(server: uvicorn.Server) -> str:
    """``http://HOST:PORT/v1`` of a started server's first socket (the real port when 0 was asked for)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


class GymserveServer(uvicorn.Server):
    """uvicorn's server, plus: the moment shutdown starts (SIGTERM/SIGINT or ``should_exit``), the
    app is marked draining, so a request that still reaches it (on a kept-alive connection) gets a
    503 ``shutting_down`` while in-flight ones finish (at most ``server.shutdown_timeout`` s).

    ``on_started(server)``, when set, runs once the sockets listen and the app is ready: the one
    moment "serving on ..." is true.
    """

    on_started: Callable[[GymserveServer], None] | None = None

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:
            # uvicorn exits when it cannot bind (the port was taken after check_port): name it.
            check_port(self.config.host, self.config.port)
            raise
        if self.started and not self.should_exit and self.on_started is not None:
            self.on_started(self)

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
            log.info(
                "shutting down: refusing new requests, waiting up to %g s for in-flight ones",
                self.config.timeout_graceful_shutdown,
            )


def _uvicorn_config(app, host: str, port: int, shutdown_timeout: float = 30.0) -> uvicorn.Config:
    # No proxy-header rewriting: nothing reads the client address, and it costs a layer per request.
    # uvicorn annotates timeout_graceful_shutdown as int but only hands it to asyncio.wait_for,
    # which takes any float; truncating would turn 0.5 s into no grace at all.
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]
        lifespan="off",
        proxy_headers=False,
    )


def _server_for(config, app) -> GymserveServer:
    return GymserveServer(
        _uvicorn_config(app, config.server.host, config.server.port, getattr(config.server, "shutdown_timeout", 30.0))
    )


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _warn_exposed(config) -> None:
    """Warn (log and stderr) when binding beyond loopback without a server API key (the control
    routes are then closed: ``server.control_routes.control_allowed``)."""
    if config.server.host not in _LOOPBACK and not _server_key(config):
        msg = (
            f"binding {config.server.host} without a server API key: anyone who can reach this address can use "
            "the model; set server.api_key (or --server-api-key-env NAME)"
        )
        if not _server_key(config, "admin_api_key"):
            msg += "; the control routes (/pause, /update_weights, ...) answer 403 until a key is set"
        log.warning(msg)
        if not logging.getLogger().handlers:
            print(f"gymserve: warning: {msg}", file=sys.stderr)


async def _listed_models(config, backend) -> list[str]:
    """What ``/v1/models`` will list, for the start-up line; [] when that is the upstream's list (a
    remote backend with no model configured: asking now would only add retries to the start-up,
    and an upstream that is down is for ``/health`` to report) or the backend cannot say in 10 s."""
    if config.served_model_names:
        return list(config.served_model_names)
    if getattr(config.backend, "public_model_name", "local") is None:
        return []
    try:
        return list(await asyncio.wait_for(backend.models(), 10))
    except Exception:  # noqa: BLE001 - a name for a message only
        return []


async def serve_async(config, backend=None, *, on_started: Callable[[str, list[str]], None] | None = None) -> None:
    """Check ``server.host:port`` is free, build the backend (unless given), serve until
    SIGINT/SIGTERM, then close the backend. ``on_started(base_url, models)`` runs once the port
    accepts connections (``base_url``: ``http://HOST:PORT/v1``, the real port when 0 was asked for;
    ``models``: the names ``/v1/models`` lists, possibly empty). Raises ``BindError`` before any
    model loads when the port cannot be bound."""
    from gymserve.backends import build_backend
    from gymserve.server.app import close_app

    check_port(config.server.host, config.server.port)
    backend = backend or build_backend(config)
    _warn_exposed(config)
    info = backend.describe()
    if info.get("tool_call_parser"):
        # `auto` must say what it chose (and why), as `vllm serve` users expect to see.
        print(
            f"gymserve: tool-call parser {info['tool_call_parser']} "
            f"({info.get('tool_call_parser_reason') or 'configured'}); reasoning parser "
            f"{info.get('reasoning_parser') or 'none'}",
            file=sys.stderr,
        )
    app = build_app(config, backend)
    server = _server_for(config, app)
    if on_started is not None:
        models = await _listed_models(config, backend)
        server.on_started = lambda started: on_started(base_url_of(started), models)
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
    by default it is built from ``config.backend``. Raises ``BindError`` when the port cannot be
    bound, the backend's start-up error, or ``TimeoutError`` after ``startup_timeout`` seconds.
    """
    bg = BackgroundServer()
    ready = threading.Event()
    check_port(config.server.host, config.server.port)

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
        server.on_started = lambda started: (setattr(bg, "base_url", base_url_of(started)), ready.set())
        task = asyncio.create_task(server.serve())
        task.add_done_callback(lambda _task: ready.set())
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
        raise RuntimeError(
            f"gymserve stopped during start-up on {config.server.host}:{config.server.port} "
            "before it served a request (see the log above)"
        )
    return bg
