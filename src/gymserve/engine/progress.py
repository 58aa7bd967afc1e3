"""Progress of long one-time work (preparing a model): a tqdm bar on a terminal, plain lines otherwise.

A preparation can take minutes with nothing else on the screen, and much of it is spent inside
single blocking calls (loading a GGUF file, writing a 2.5 GB safetensors file). So a step is
reported by a heartbeat thread as well as by its own updates:

- stderr is a terminal: a tqdm bar, refreshed at least once a second so the elapsed time moves,
  and a ``done in N s`` line when the step ends.
- stderr is not a terminal (CI logs, ``gymserve demo | tee``): one plain line when the step starts,
  then one line every ``interval_s`` seconds (10 s) or every 10 % of the total, whichever comes
  first (10 % lines at least ``interval_s / 5`` apart), and one line when it ends, e.g. ::

      gymserve: [2/3] de-quantizing GGUF tensors: 120/291 tensors (41%), 12 s elapsed
      gymserve: [2/3] de-quantizing GGUF tensors: done in 31 s

Lines go to ``sys.stderr`` (looked up when the step starts, so pytest's ``capsys`` and redirected
streams see them); stdout stays free for what a command prints as its result.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Self, TextIO

PLAIN_INTERVAL_S = 10.0
PLAIN_STEP = 0.10  # a plain line at least every 10 % of the total
_REFRESH_S = 1.0  # heartbeat period: the bar's clock, the poll, the plain-line check


def say(message: str, stream: TextIO | None = None) -> None:
    """Print one ``gymserve: …`` line on stderr (or ``stream``) and flush it at once."""
    stream = stream or sys.stderr
    print(f"gymserve: {message}", file=stream, flush=True)


def _amount(value: float, unit: str) -> str:
    if unit == "B":
        for size, suffix in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):  # decimal, as file sizes are quoted
            if value >= size:
                return f"{value / size:.1f} {suffix}"
        return f"{value:.0f} B"
    return f"{value:.0f}"


def _is_tty(stream: TextIO) -> bool:
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):  # closed, or not a file
        return False
    try:
        # A terminal nobody sized (0 columns: some CI runners, `script` without a terminal) gets
        # plain lines: tqdm would draw nothing there.
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # says it is a terminal but has no descriptor
        return True


class Progress:
    """One step of long work, shown while it runs; use as a context manager.

    ``desc``: what the step does ("assembling the GGUF"). ``total``: units of work (bytes when
    ``unit == "B"``, else e.g. tensors), None when unknown. ``poll``: a callable returning the units
    done so far, read by the heartbeat (for work done inside a call that reports nothing, such as
    the size of a file being written). ``stream``: default ``sys.stderr``; ``tty``: force the bar
    (True) or plain lines (False) instead of asking the stream. ``interval_s``: seconds between
    plain lines (10).
    """

    def __init__(
        self,
        desc: str,
        total: float | None = None,
        unit: str = "",
        *,
        poll: Callable[[], float] | None = None,
        stream: TextIO | None = None,
        tty: bool | None = None,
        interval_s: float = PLAIN_INTERVAL_S,
    ):
        self.desc = desc
        self.total = total
        self.unit = unit
        self.done: float = 0
        self._poll = poll
        self._stream = stream or sys.stderr
        self._tty = _is_tty(self._stream) if tty is None else tty
        self._interval = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._last_line = self._start
        self._next_fraction = PLAIN_STEP
        self._bar = None
        if self._tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit or "it",
                unit_scale=unit == "B",
                file=self._stream,
                leave=False,
                dynamic_ncols=True,
            )
        else:
            say(f"{desc}...", self._stream)
        self._thread = threading.Thread(target=self._heartbeat, name="gymserve-progress", daemon=True)
        self._thread.start()

    @property
    def elapsed_s(self) -> float:
        """Seconds since the step started."""
        return time.monotonic() - self._start

    def set_total(self, total: float) -> None:
        """Set the total once it is known (e.g. the number of tensors, after opening the file)."""
        with self._lock:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

    def update(self, n: float = 1) -> None:
        """Record ``n`` more units done."""
        with self._lock:
            self._advance(self.done + n)

    def _advance(self, done: float) -> None:
        # Called with self._lock held.
        if self._bar is not None:
            self._bar.update(done - self.done)
        self.done = done
        # A fast step would print ten lines in a second: the 10 % lines keep a fifth of the interval apart.
        if (
            self._bar is None
            and self.total
            and done < self.total
            and done / self.total >= self._next_fraction
            and time.monotonic() - self._last_line >= self._interval / 5
        ):
            while self._next_fraction <= done / self.total:
                self._next_fraction += PLAIN_STEP
            self._line()

    def _line(self) -> None:
        # Called with self._lock held.
        self._last_line = time.monotonic()
        elapsed = f"{self._last_line - self._start:.0f} s elapsed"
        if self.total:
            pct = 100 * self.done / self.total
            amount = f"{_amount(self.done, self.unit)}/{_amount(self.total, self.unit)}"
            unit = "" if self.unit in ("B", "") else f" {self.unit}"
            say(f"{self.desc}: {amount}{unit} ({pct:.0f}%), {elapsed}", self._stream)
        else:
            say(f"{self.desc}: {elapsed}", self._stream)

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(self._interval, _REFRESH_S)):
            with self._lock:
                if self._poll is not None:
                    try:
                        self._advance(self._poll())
                    except OSError:  # e.g. the file being measured is not there yet
                        pass
                if self._bar is not None:
                    self._bar.refresh()
                elif time.monotonic() - self._last_line >= self._interval:
                    self._line()

    def close(self, ok: bool = True) -> None:
        """End the step: stop the heartbeat, close the bar, and (plain lines) say how long it took."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            self._bar.close()
        if ok:
            say(f"{self.desc}: done in {self.elapsed_s:.0f} s", self._stream)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
