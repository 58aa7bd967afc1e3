"""Optional capture of every model call to a JSONL file, for debugging rollouts.

One line per call: ``{"time", "route", "request_id", "session", "backend", "replica", "status",
"latency_s", "stream", "request", "response" | "error"}``. Request headers are never written (the
client's key travels there); every line goes through ``upstream_errors.redact`` with the
configured secrets (upstream API keys, Azure AD token, the server's own key) and key-shaped
strings, so no key reaches the file even if an upstream echoes one back.

Lines are serialized on the event loop (orjson, cheap) and written by one daemon thread, so the
event loop never waits on the disk. The queue is bounded (``max_pending`` lines); when the disk
cannot keep up, lines are dropped, counted in ``gymserve_capture_dropped_total`` and logged, rather
than growing memory without bound. ``close()`` writes everything still queued.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from typing import Any

import orjson

from gymserve.redaction import redact

log = logging.getLogger("gymserve.server.capture")
_STOP = object()

# Third-party loggers that print request URLs or options (httpx at INFO: "HTTP Request: POST <url>",
# the openai SDK at DEBUG): a key in a base URL's query or an echoed credential would reach the log.
_CLIENT_LOGGERS = (
    "httpx",
    "httpx2",
    "httpcore.http11",
    "httpcore.connection",
    "httpcore2.http11",
    "httpcore2.connection",
    "openai._base_client",
    "openai",
)
# A key-like query parameter in a logged URL (``?api_key=...``, ``&sig=...``), masked even when
# the value is not a configured secret.
_URL_SECRET = re.compile(r"([?&][^=&\s]*(?:key|token|secret|sig|password)[^=&\s]*=)[^&\s\"']+", re.I)


class RedactingFilter(logging.Filter):
    """Rewrites a record's message with ``redact`` (configured secrets and key-shaped strings)."""

    def __init__(self):
        super().__init__("gymserve-redact")
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the logger's problem, not ours
            return True
        clean = _URL_SECRET.sub(r"\1***", redact(text, tuple(self.secrets)))
        if clean != text:
            record.msg, record.args = clean, None
        return True


_FILTER = RedactingFilter()


def install_log_redaction(secrets: tuple[str, ...] = ()) -> None:
    """Redact ``secrets`` (and key-shaped strings) from the HTTP client libraries' log records."""
    _FILTER.secrets.update(s for s in secrets if s and len(s) >= 4)
    for name in _CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


class CaptureWriter:
    """Appends redacted JSON lines to ``path`` from a background thread."""

    def __init__(self, path: str, *, secrets: tuple[str, ...] = (), max_pending: int = 100_000, on_drop=None):
        self.path = path
        self.secrets = tuple(s for s in secrets if s)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._on_drop = on_drop
        self.dropped = 0
        self.written = 0
        self._file = open(path, "ab")  # noqa: SIM115 - closed by the writer thread
        self._thread = threading.Thread(target=self._run, name="gymserve-capture", daemon=True)
        self._thread.start()

    def record(self, **fields: Any) -> None:
        """Queue one call's record (never blocks; drops and counts when the queue is full)."""
        fields.setdefault("time", time.time())
        try:
            line = orjson.dumps(fields, default=str, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as exc:  # an unserializable value: keep the call, note the problem
            line = orjson.dumps(
                {k: v for k, v in fields.items() if k not in ("request", "response")}
                | {"capture_error": f"not serializable: {exc}"},
                default=str,
            )
        text = redact(line.decode(), self.secrets)
        try:
            self._queue.put_nowait(text.encode() + b"\n")
        except queue.Full:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("capture %s cannot keep up: %d records dropped so far", self.path, self.dropped)

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                batch = [item]
                while True:  # drain what is there, one write + flush per batch
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = any(x is _STOP for x in batch)
                lines = [x for x in batch if x is not _STOP]
                if lines:
                    self._file.write(b"".join(lines))
                    self._file.flush()
                    self.written += len(lines)
                if stop:
                    return
        except Exception:  # noqa: BLE001 - a broken disk must not take the server down
            log.exception("capture writer for %s failed; capture stops", self.path)
        finally:
            self._file.close()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then close the file (waits at most ``timeout`` seconds)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("capture %s: queue still full at close; some records are lost", self.path)
            return
        self._thread.join(timeout)
