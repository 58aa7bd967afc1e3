"""Replicas, session affinity, health, concurrency limits and retry delays for remote backends.

- ``ReplicaPool``: several base URLs of one model. A new session is assigned round-robin among the
  healthy replicas, then sticks to its replica so a multi-turn rollout keeps hitting the same
  prefix (KV) cache; requests without a session go round-robin. A replica that fails to connect is
  marked unhealthy and skipped. A background probe (the backend's ``probe``; the chat backend's is
  ``GET {base}/models``) runs once as soon as the pool starts and then every ``interval`` seconds,
  so health is known at start-up and follows each replica within one interval: a failed probe
  marks the replica down, an answered one brings it back. When every replica is unhealthy requests
  still go out (round-robin), so a recovered server is used before the next probe.
- ``Limiter``: at most ``limit`` calls in flight and ``max_queue`` waiting; beyond that
  ``OverloadedError`` (429 with ``retry_after``), so overload turns into back-pressure instead of
  unbounded memory and latency.
- ``backoff_delay``: exponential backoff with jitter, honouring an upstream ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gymserve.errors import OverloadedError

log = logging.getLogger("gymserve.backends.pool")

MAX_BACKOFF = 8.0


@dataclass(eq=False)
class Replica:
    """One upstream server. ``client`` is its SDK client; ``last_error`` says why it is unhealthy;
    ``last_probe_at``: when the last probe of it ended (Unix seconds; None before the first)."""

    base_url: str
    client: Any = None
    healthy: bool = True
    last_error: str | None = None
    in_flight: int = 0
    sessions: int = field(default=0)
    last_probe_at: float | None = None


R = TypeVar("R", bound=Replica)


class ReplicaPool(Generic[R]):
    """Chooses a replica per request; see the module docstring for the policy.

    ``probe(replica)`` must raise when the replica is down, its message saying why (it is called
    for every replica once when ``start()`` runs inside an event loop, then every ``interval``
    seconds; ``interval == 0`` disables probing). ``max_sessions`` bounds the affinity table (least
    recently used sessions are forgotten). Generic in the replica type, so a backend gets its own
    ``Replica`` subclass back from ``pick``.
    """

    def __init__(
        self,
        replicas: list[R],
        *,
        probe: Callable[[R], Awaitable[Any]] | None = None,
        interval: float = 10.0,
        max_sessions: int = 100_000,
    ):
        if not replicas:
            raise ValueError("a replica pool needs at least one replica")
        self.replicas = replicas
        self._probe = probe
        self._interval = interval
        self._rr = itertools.count()
        self._sessions: OrderedDict[str, R] = OrderedDict()
        self._max_sessions = max_sessions
        self._task: asyncio.Task | None = None
        self._first_round = asyncio.Event()  # set when every replica has been probed once

    def _next_healthy(self, candidates: list[R] | None = None) -> R:
        candidates = self.replicas if candidates is None else candidates
        healthy = [r for r in candidates if r.healthy] or candidates
        return healthy[next(self._rr) % len(healthy)]

    def pick(self, session_id: str | None = None, accept: Callable[[R], bool] | None = None) -> R:
        """The replica for this request: the session's own if healthy, else a round-robin choice
        (recorded for the session). ``accept``: only replicas it returns True for may serve (the
        Ray backend passes "is on the call's weight version"); ``LookupError`` when none does."""
        self.start()
        candidates = self.replicas if accept is None else [r for r in self.replicas if accept(r)]
        if not candidates:
            raise LookupError  # internal: the caller says why (e.g. ray_cluster.control.no_replica_error)
        if session_id is None:
            return self._next_healthy(candidates)
        replica = self._sessions.get(session_id)
        if (
            replica is not None
            and replica in candidates
            and (replica.healthy or not any(r.healthy for r in candidates))
        ):
            self._sessions.move_to_end(session_id)
            return replica
        if replica is not None:
            replica.sessions -= 1
            log.info("session %s moves off replica %s (unhealthy or not acceptable)", session_id, replica.base_url)
        replica = self._next_healthy(candidates)
        self._sessions[session_id] = replica
        replica.sessions += 1
        if len(self._sessions) > self._max_sessions:
            _, old = self._sessions.popitem(last=False)
            old.sessions -= 1
        return replica

    def mark_down(self, replica: R, reason: str) -> None:
        if replica.healthy:
            log.warning("replica %s marked unhealthy: %s", replica.base_url, reason)
        replica.healthy, replica.last_error = False, reason

    def mark_up(self, replica: R) -> None:
        if not replica.healthy:
            log.info("replica %s is healthy again", replica.base_url)
        replica.healthy, replica.last_error = True, None

    async def check_all(self) -> None:
        """Probe every replica once, updating health."""
        probe = self._probe
        if probe is None:
            return

        async def one(replica: R) -> None:
            try:
                await probe(replica)
            except Exception as exc:  # any failure means "not usable now"
                self.mark_down(replica, getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
            else:
                self.mark_up(replica)
            finally:
                replica.last_probe_at = time.time()

        await asyncio.gather(*(one(r) for r in self.replicas))

    @property
    def probing(self) -> bool:
        """Whether this pool probes its replicas in the background (a probe and an interval > 0)."""
        return self._probe is not None and self._interval > 0

    def start(self) -> None:
        """Start the background probe: a first round now, then one every ``interval`` seconds
        (idempotent; needs a running event loop, else the first ``pick`` starts it)."""
        if self._task is not None or not self.probing:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._loop(), name="gymserve-replica-health")

    async def first_probe(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until every replica has been probed once (starting the
        probe if needed); returns at once when probing is off or the first round is done."""
        self.start()
        if self._task is None or self._first_round.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._first_round.wait()

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_all()
            finally:
                self._first_round.set()
            # Rounds start every interval (not interval after a slow probe), so a change is seen
            # within one interval plus one probe.
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    def status(self) -> dict[str, Any]:
        """``{"status": ok|degraded|down, "probe_interval_s", "replicas": [{base_url, healthy,
        last_probe_at, last_error, in_flight, sessions}]}`` for ``/health``; ``last_probe_at`` is
        Unix seconds (None before the first probe; ``probe_interval_s`` 0: no background probe)."""
        up = sum(r.healthy for r in self.replicas)
        state = "ok" if up == len(self.replicas) else "degraded" if up else "down"
        return {
            "status": state,
            "probe_interval_s": self._interval if self.probing else 0,
            "replicas": [
                {
                    "base_url": r.base_url,
                    "healthy": r.healthy,
                    "last_probe_at": round(r.last_probe_at, 3) if r.last_probe_at is not None else None,
                    "last_error": r.last_error,
                    "in_flight": r.in_flight,
                    "sessions": r.sessions,
                }
                for r in self.replicas
            ],
        }

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._task
            self._task = None


class Limiter:
    """At most ``limit`` concurrent calls and ``max_queue`` waiting ones (``OverloadedError`` beyond)."""

    def __init__(self, limit: int, max_queue: int, *, name: str = "backend"):
        self.limit, self.max_queue, self.name = limit, max_queue, name
        self._sem = asyncio.Semaphore(limit)
        self.waiting = 0
        self.running = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._sem.locked() and self.waiting >= self.max_queue:
            raise OverloadedError(
                f"{self.name} is overloaded: {self.running} requests running (num_concurrent_requests={self.limit}) "
                f"and {self.waiting} queued (max_queue={self.max_queue}); retry later",
                retry_after=1.0,
            )
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._sem.release()


def backoff_delay(attempt: int, initial: float, retry_after: float | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): ``initial * 2**attempt`` capped at 8 s,
    minus up to 25 % jitter (as the openai SDK does); an upstream Retry-After up to 60 s wins."""
    if retry_after is not None and 0 < retry_after <= 60:
        return retry_after
    return min(initial * (2**attempt), MAX_BACKOFF) * (1 - 0.25 * random.random())
