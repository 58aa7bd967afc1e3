"""Example RL environments: tools an agent can call, and a verifier that scores a finished rollout.

An environment is anything with this shape (see ``Environment``):

- ``name``: what a rollout task's ``"env"`` field names;
- ``tools``: Responses function tools (``{"type": "function", "name", "description", "parameters"}``);
- ``instructions``: default system instructions, used when the task gives none;
- ``await call_tool(name, arguments_json) -> str``: run one ``function_call``; the string becomes the
  ``output`` of the ``function_call_output`` item. Tool errors come back as a JSON string
  ``{"error": ...}`` (the model should see them), never as exceptions;
- ``verify(task, output_items) -> float``: the reward of a finished rollout, in ``[0, 1]``.

``open_environments(names)`` starts what the named environments need (the weather env runs a real
tools server on 127.0.0.1) and closes it afterwards. ``BackgroundApp`` runs any ASGI app in a
thread on 127.0.0.1 with an ephemeral port (the weather tools server, fake servers in tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import uvicorn


@runtime_checkable
class Environment(Protocol):
    name: str
    tools: list[dict[str, Any]]
    instructions: str | None

    async def call_tool(self, name: str, arguments: str) -> str: ...

    def verify(self, task: dict[str, Any], output_items: list[dict[str, Any]]) -> float: ...

    async def aclose(self) -> None: ...


ENV_NAMES = ("weather",)
"""Environments a rollout task may name in its ``"env"`` field."""


class UnknownEnvironmentError(ValueError):
    """A task named an environment gymserve does not have."""


class BackgroundApp:
    """Serve an ASGI app with uvicorn in a daemon thread on ``127.0.0.1`` (port 0 → a free port).

    ``url`` is ``http://127.0.0.1:PORT``. Use as a context manager or call ``start()``/``stop()``.
    A thread (not a task on the caller's loop) keeps the server responsive while the caller's event
    loop is busy or blocked, and works from sync and async code alike.
    """

    def __init__(self, app: Any, *, port: int = 0, startup_timeout: float = 20.0):
        self.app = app
        self.port = port
        self.startup_timeout = startup_timeout
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> BackgroundApp:
        import uvicorn

        # Bind the socket ourselves so port 0 resolves before uvicorn starts (no race on the port).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on")
        server = self._server = uvicorn.Server(config)
        # uvicorn installs signal handlers only in the main thread; in ours it must not. Uvicorn
        # before 0.29 had this hook; later ones (the typed ones) skip signals off the main thread
        # themselves and have no such attribute, so the assignment is then a harmless no-op.
        server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=lambda: asyncio.run(server.serve(sockets=[sock])), name="gymserve-bg-app", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"background app on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> BackgroundApp:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.asynccontextmanager
async def open_environments(names: Iterable[str]) -> AsyncIterator[dict[str, Environment]]:
    """Start the named environments (each once, shared by every rollout) and close them on exit.

    Yields ``{name: Environment}``. Raises ``UnknownEnvironmentError`` listing the known names.
    """
    envs: dict[str, Environment] = {}
    stack = contextlib.AsyncExitStack()
    async with stack:
        for name in dict.fromkeys(names):
            if name == "weather":
                from gymserve.harness.envs.weather import WeatherEnv

                envs[name] = await stack.enter_async_context(WeatherEnv.serve())
            else:
                raise UnknownEnvironmentError(
                    f"unknown environment {name!r}; known environments: {', '.join(ENV_NAMES)}"
                )
        yield envs
