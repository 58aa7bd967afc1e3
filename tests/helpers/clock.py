"""A clock the test sets by hand, for code that takes ``clock=`` (the replica pool, its circuit
breakers and retry budget)."""

from __future__ import annotations


class ManualClock:
    """Returns ``now`` (seconds) until the test moves it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
