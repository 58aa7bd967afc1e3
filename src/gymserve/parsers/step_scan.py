"""The loop every incremental scanner of generated text runs (tool calls, harmony channels, XML).

A scanner is a small state machine over a text that only grows: :meth:`StepScanner.feed` appends
a delta, :meth:`StepScanner.finish` says the text is complete, and each runs the current mode's
step until one returns False (it waits for more text, or the text is done), returning the
:data:`~gymserve.parsers.call_scan.ScanEvent` objects the steps decided. Steps read ``_final`` to
decide what more text could still have changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepScanner:
    """Base class: subclasses set ``mode`` and return ``{mode: step}`` from :meth:`_steps`."""

    mode: str

    def __init__(self) -> None:
        self.text = ""
        self._final = False
        self._out: list[Any] = []

    def feed(self, delta: str) -> list[Any]:
        """Add generated text; returns the events it decided."""
        self.text += delta
        return self._run()

    def finish(self) -> list[Any]:
        """The text is complete; returns the remaining events."""
        self._final = True
        return self._run()

    def _steps(self) -> dict[str, Callable[[], bool]]:
        raise NotImplementedError

    def _run(self) -> list[Any]:
        self._out = []
        steps = self._steps()
        while steps[self.mode]():
            pass
        return self._out
