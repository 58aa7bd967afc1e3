"""``RoutingPolicy``: the one decision a policy makes — which eligible replica serves a call.

Everything else is the pool's (``backends.pool.ReplicaPool``): which replicas are eligible
(health, circuit breaker, ``Retry-After``, the caller's filters), the session table, load counts,
statistics. A policy sees the replicas through two calls:

- ``stay(home, eligible)`` — a session's previous replica is eligible: does this turn stay there?
  (Sticky policies keep it unless it is far more loaded than the rest; the others say no and
  ``place`` decides.)
- ``place(eligible, session_id)`` — choose among the replicas for which ``eligible(replica)`` is
  true; None when there is none (the pool then relaxes its filters or fails the call).

Each policy is one module under ``backends/routing/`` and one line in
``gymserve.registry.ROUTING_POLICIES``; ``routing.policy`` in the config names it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from gymserve.backends.pool import Replica

R = TypeVar("R", bound="Replica")
Eligible = Callable[[Any], bool]  # called with the pool's replicas


class RoutingPolicy(ABC, Generic[R]):
    """Chooses a replica per call (see the module docstring).

    ``replicas``: the pool's replicas, in configured order (fixed for the pool's life).
    ``config``: a ``gymserve.config.RoutingConfig`` (or anything with its attributes).
    """

    name: ClassVar[str]

    def __init__(self, replicas: Sequence[R], config: object):
        self.replicas = list(replicas)
        self.config = config

    def stay(self, home: R, eligible: Eligible) -> bool:
        """Whether a session's turn stays on ``home`` (its previous replica, eligible). Default: no."""
        return False

    @abstractmethod
    def place(self, eligible: Eligible, session_id: str | None) -> R | None:
        """An eligible replica for this call, or None when no replica is eligible."""


class Rotation:
    """Rotating through replicas in order, skipping ineligible ones: O(1) per call while most are
    eligible. Shared by the policies that need a tie-breaker or a fallback for calls without a session."""

    def __init__(self, replicas: Sequence[Replica]):
        self._replicas = list(replicas)
        self._next = 0

    def take(self, eligible: Eligible) -> Replica | None:
        """The next eligible replica after the last one taken (None when none is eligible)."""
        n = len(self._replicas)
        for step in range(n):
            i = (self._next + step) % n
            if eligible(self._replicas[i]):
                self._next = i + 1
                return self._replicas[i]
        return None

    @property
    def start(self) -> int:
        """Where the next scan starts (a tie-breaker that changes from call to call)."""
        return self._next

    def taken(self, index: int) -> None:
        """The replica at ``index`` was chosen by another rule: the next scan starts after it."""
        self._next = index + 1
