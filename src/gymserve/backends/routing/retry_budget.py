"""``RetryBudget``: retries as a bounded fraction of recent successful calls, so failures cannot
multiply the load on a fleet that is already failing (a retry storm).

The rule is Finagle's ``RetryBudget`` (https://finagle.github.io/blog/2016/02/08/retry-budgets:
"20% of requests to be retried on top of a minimum of 10 retries per second ... a token bucket where
credits expire after 10 seconds"; tower's ``retry::budget`` is the same in Rust; Envoy's
``retry_budget`` bounds concurrent retries as a percentage of active requests instead). Here a
deposit is a *successful* call, so when every call fails the budget falls to its floor and stays
there:

    allowed retries in the last ``window`` s = min_per_s × window + ratio × successes − retries

Counts are kept in ten slots of ``window / 10`` seconds each, so a deposit expires 0.9-1.0 ``window``
after it was made and every operation is O(1). Time comes from ``clock`` (seconds, monotonic).
"""

from __future__ import annotations

import time
from collections.abc import Callable

SLOTS = 10


class RetryBudget:
    """A retry budget shared by every request of one backend (see the module docstring).

    ``ratio`` ≥ 0: retries allowed per successful call; ``min_per_s`` ≥ 0: the floor, in retries per
    second; ``window`` (1-60 s, as Finagle's ``ttl``): how long a deposit counts. ``retries`` and
    ``denied`` count withdrawals made and refused (for ``/metrics``).
    """

    def __init__(
        self,
        ratio: float = 0.2,
        min_per_s: float = 10.0,
        window: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if ratio < 0 or min_per_s < 0 or not 1 <= window <= 60:
            raise ValueError("a retry budget needs ratio >= 0, min_per_s >= 0 and 1 <= window <= 60 seconds")
        self.ratio, self.min_per_s, self.window = ratio, min_per_s, window
        self._clock = clock
        self._slot_s = window / SLOTS
        self._epochs = [-1] * SLOTS  # which slot-epoch each slot's counts belong to
        self._successes = [0] * SLOTS
        self._withdrawn = [0] * SLOTS
        self.retries = 0
        self.denied = 0

    def _slot(self) -> int:
        epoch = int(self._clock() / self._slot_s)
        i = epoch % SLOTS
        if self._epochs[i] != epoch:  # a slot from an earlier lap: its counts have expired
            self._epochs[i], self._successes[i], self._withdrawn[i] = epoch, 0, 0
        return i

    def _live(self, counts: list[int]) -> int:
        now_epoch = int(self._clock() / self._slot_s)
        return sum(c for c, e in zip(counts, self._epochs) if now_epoch - e < SLOTS)

    @property
    def balance(self) -> float:
        """Retries allowed now (may be fractional; a retry needs at least 1)."""
        return self.min_per_s * self.window + self.ratio * self._live(self._successes) - self._live(self._withdrawn)

    def deposit(self) -> None:
        """One call succeeded."""
        self._successes[self._slot()] += 1

    def try_withdraw(self) -> bool:
        """Take one retry if the balance allows it; False (and ``denied`` + 1) when it does not."""
        if self.balance < 1:
            self.denied += 1
            return False
        self._withdrawn[self._slot()] += 1
        self.retries += 1
        return True
