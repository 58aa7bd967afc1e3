"""``CircuitBreaker``: one replica's passive health, from the outcomes of real calls.

The classic three states (Nygard, *Release It!*; the same machine as Envoy's outlier detection and
resilience4j's breaker):

- **closed** — calls flow; ``failure_threshold`` consecutive failures (5xx, timeouts, unreadable
  answers) open it; a success resets the count. A refused or reset connection, or a Ray actor that
  died, ``trip``\\ s it at once: nothing is listening, so there is nothing to count.
- **open** — the replica gets no calls for ``cooldown`` seconds; the cool-down doubles each time
  the breaker re-opens in a row, up to 8× (Envoy lengthens its ejection time the same way, bounded
  by ``max_ejection_time``), so a replica that stays broken costs one trial call per growing interval.
- **half-open** — after the cool-down (or as soon as an active health probe answers, as Envoy's
  ``successful_active_health_check_uneject_host`` does) exactly one trial call may go; its success
  closes the breaker, its failure opens it again.

Time comes from ``clock`` (seconds, monotonic), so tests and the fleet simulation can drive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]
MAX_COOLDOWN_FACTOR = 8


class CircuitBreaker:
    """A replica's breaker (see the module docstring). Not thread-safe: one event loop owns it.

    ``failure_threshold`` ≥ 1 consecutive failures open it; ``cooldown`` > 0 seconds later it lets
    one trial call through. ``opens`` counts how often it opened (for ``/metrics``);
    ``last_reason`` is the failure that opened it last.
    """

    def __init__(
        self, failure_threshold: int = 5, cooldown: float = 10.0, *, clock: Callable[[], float] = time.monotonic
    ):
        if failure_threshold < 1 or cooldown <= 0:
            raise ValueError("a circuit breaker needs failure_threshold >= 1 and cooldown > 0")
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self._clock = clock
        self._open = False
        self._opened_at = 0.0
        self._reopens = 0  # consecutive opens without a success in between: the cool-down's exponent
        self._half_open_early = False  # a probe answered while open
        self.failures = 0  # consecutive failures while closed
        self.trial_in_flight = False
        self.opens = 0
        self.last_reason: str | None = None

    @property
    def current_cooldown(self) -> float:
        """Seconds this opening lasts: ``cooldown`` doubled per consecutive re-opening, at most 8×."""
        return self.cooldown * min(2**self._reopens, MAX_COOLDOWN_FACTOR)

    @property
    def state(self) -> BreakerState:
        if not self._open:
            return "closed"
        if self._half_open_early or self._clock() >= self._opened_at + self.current_cooldown:
            return "half_open"
        return "open"

    def allows(self) -> bool:
        """Whether a call may go now: closed, or half-open with no trial call out yet."""
        if not self._open:
            return True
        return self.state == "half_open" and not self.trial_in_flight

    def on_pick(self) -> None:
        """A call was routed here: in half-open it is the trial (no second one until it ends)."""
        if self._open:
            self.trial_in_flight = True

    def success(self) -> None:
        """A call was answered: close (a half-open trial succeeded) and reset the failure count."""
        self._open = self._half_open_early = self.trial_in_flight = False
        self.failures = self._reopens = 0

    def failure(self, reason: str) -> None:
        """A call failed in a way that blames the replica: count it; open at the threshold, or again
        at once when it was the half-open trial."""
        self.last_reason = reason
        if self._open:
            if self.trial_in_flight or self.state == "half_open":
                self._reopen()
            return
        self.failures += 1
        if self.failures >= self.failure_threshold:
            self._open_now(reopen=False)

    def trip(self, reason: str) -> None:
        """Open now, whatever the count (nothing listens at the replica's address)."""
        self.last_reason = reason
        if self._open:
            if self.trial_in_flight or self.state == "half_open":
                self._reopen()
            return
        self._open_now(reopen=False)

    def cancelled(self) -> None:
        """A call here ended without an outcome (the client left): free the trial slot."""
        self.trial_in_flight = False

    def probe_answered(self) -> None:
        """An active health probe got an answer: an open breaker may try a call now (half-open)."""
        if self._open:
            self._half_open_early = True

    def reset(self) -> None:
        """Close, as if the replica had never failed (an operator or ``ReplicaPool.mark_up`` says so)."""
        self.success()
        self.last_reason = None

    def _open_now(self, *, reopen: bool) -> None:
        self._open = True
        self._opened_at = self._clock()
        self._half_open_early = self.trial_in_flight = False
        self.failures = 0
        self._reopens = self._reopens + 1 if reopen else 0
        self.opens += 1

    def _reopen(self) -> None:
        self._open_now(reopen=True)
