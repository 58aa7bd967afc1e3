"""What the ``gymserve`` command prints when something fails, and where the full story goes.

Three kinds of failure, told apart by ``classify``:

- **known**: gymserve's own errors for things a user fixes — a bad config or flag (``ConfigError``),
  a model that cannot be prepared (``ModelStoreError``), a port that cannot be bound
  (``server.run.BindError``), an upstream that refused or could not be reached (``GymserveError``,
  the openai SDK's ``APIError``, httpx's ``HTTPError``), a missing optional package (``ImportError``,
  whose message names what to install). Their message is the whole report.
- **plain**: ``ValueError``, ``OSError`` and ``RuntimeError`` raised with a message meant for the
  user (a bad tasks file, a disk that is full); the message is printed, and the traceback is kept
  in a file in case the message is not enough.
- **bug**: anything else (``TypeError``, ``KeyError``, ...). One line says what failed and where
  (file, line, function), and the traceback is written to a file under the cache directory
  (``<cache>/logs/``, ``gymserve.engine.model_store.cache_dir``); ``--debug`` prints it instead.

This module is shared by the CLI and by the commands that catch their own errors (``demo``,
``rollout``) so both print the same thing; it imports nothing heavy.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Literal, TextIO

Kind = Literal["known", "plain", "bug"]


def _known_types() -> tuple[type[BaseException], ...]:
    from gymserve.config import ConfigError
    from gymserve.engine.model_store import ModelStoreError
    from gymserve.errors import GymserveError
    from gymserve.registry import UnknownNameError
    from gymserve.server.run import BindError

    types: list[type[BaseException]] = [
        ConfigError,
        ModelStoreError,
        GymserveError,
        UnknownNameError,
        BindError,
        ImportError,
    ]
    for module, name in (("openai", "APIError"), ("httpx", "HTTPError"), ("pydantic", "ValidationError")):
        mod = sys.modules.get(module)  # only classes already imported can have been raised
        if mod is not None and hasattr(mod, name):
            types.append(getattr(mod, name))
    return tuple(types)


def classify(exc: BaseException) -> Kind:
    """``"known"``, ``"plain"`` or ``"bug"``; see the module docstring."""
    if isinstance(exc, _known_types()):
        return "known"
    if isinstance(exc, (ValueError, OSError, RuntimeError)) and str(exc):
        return "plain"
    return "bug"


def _request_url(exc: BaseException) -> str | None:
    try:
        request = getattr(exc, "request", None)
        return str(request.url) if request is not None else None
    except RuntimeError:  # httpx raises when an error carries no request
        return None


def message(exc: BaseException) -> str:
    """One line (or a short block, for config errors) saying what went wrong and what to do."""
    openai = sys.modules.get("openai")
    httpx = sys.modules.get("httpx")
    url = _request_url(exc)
    if openai is not None and isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        why = f"{type(cause).__name__}: {cause}" if cause is not None and str(cause) else exc.message
        return f"cannot reach {url or 'the endpoint'} ({why}); is the server running, and is the base URL right?"
    if openai is not None and isinstance(exc, openai.APIStatusError):
        return f"{url or 'the endpoint'} answered HTTP {exc.status_code}: {exc.message}"
    if httpx is not None and isinstance(exc, httpx.TransportError):
        return f"cannot reach {url or 'the endpoint'} ({type(exc).__name__}: {exc}); is the server running?"
    if isinstance(exc, OSError) and exc.strerror and not str(exc).startswith(exc.strerror):
        # "[Errno 28] No space left on device: 'x'" -> "No space left on device: x"
        target = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{target}"
    text = getattr(exc, "message", None)
    return text if isinstance(text, str) and text else (str(exc) or type(exc).__name__)


def origin(exc: BaseException) -> str:
    """Where ``exc`` was raised, as ``gymserve/module.py:LINE in function``: the innermost frame inside
    the gymserve package when there is one (a library's own frame says less about what failed),
    else the innermost frame."""
    package = Path(__file__).resolve().parent
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an unknown place"

    def inside(filename: str) -> Path | None:
        try:
            return Path(filename).resolve().relative_to(package)
        except ValueError:
            return None

    ours = [(f, rel) for f in frames if (rel := inside(f.filename)) is not None]
    if ours:
        frame, rel = ours[-1]
        return f"gymserve/{rel.as_posix()}:{frame.lineno} in {frame.name}"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def _log_dirs() -> list[Path]:
    from gymserve.engine.model_store import cache_dir

    return [cache_dir() / "logs", Path(tempfile.gettempdir()) / "gymserve-logs"]


def write_traceback(exc: BaseException, command: str) -> Path | None:
    """Write ``exc``'s full traceback (and the command line) to a new file under ``<cache>/logs/``
    (or the temp directory when the cache is not writable); returns its path, None when neither is."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    text = (
        f"gymserve {command} failed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        f"argv: {sys.argv!r}\npython: {sys.version.split()[0]}\n\n" + "".join(traceback.format_exception(exc))
    )
    for directory in _log_dirs():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"{command.replace(' ', '-') or 'gymserve'}-{stamp}-{os.getpid()}.log"
            path.write_text(text, encoding="utf-8")
            return path
        except OSError:
            continue
    return None


DEBUG_ENV = "GYMSERVE_DEBUG"


def report(exc: BaseException, command: str, *, debug: bool | None = None, out: TextIO | None = None) -> int:
    """Print ``exc`` for a user of ``gymserve COMMAND``; returns the exit code (2 known or plain, 1 bug).

    ``debug``: print the full traceback too (and write no file); None: when ``$GYMSERVE_DEBUG`` is
    set to anything but ``0`` (``gymserve --debug`` sets it, so commands that report their own
    failures follow the flag).
    """
    out = out or sys.stderr
    if debug is None:
        debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    kind = classify(exc)
    prefix = f"gymserve {command}:" if command else "gymserve:"
    if debug:
        traceback.print_exception(exc, file=out)
    if kind == "bug":
        head = f"{prefix} unexpected error at {origin(exc)}: {type(exc).__name__}: {message(exc)}"
        if debug:
            print(f"{head} (a bug in gymserve; please report it with the traceback above)", file=out)
            return 1
        path = write_traceback(exc, command)
        where = f"the full traceback is in {path}" if path else "no log file could be written"
        print(f"{head}; {where} (rerun with --debug to print it; please report it as a gymserve bug)", file=out)
        return 1
    text = message(exc)
    if kind == "plain" and not debug:
        path = write_traceback(exc, command)
        text += f" (traceback: {path})" if path else ""
    print(f"{prefix} {text}", file=out)
    return 2
