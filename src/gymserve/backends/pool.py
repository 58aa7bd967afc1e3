"""Replicas, routing, health, concurrency limits and retry delays for backends with several servers.

- ``ReplicaPool``: the replicas of one model and every routing decision about them, shared by the
  chat backend (``caller.UpstreamCaller``) and the Ray backend. ``pick`` chooses a replica for a
  call with the configured policy (``routing``: ``sticky-least-loaded`` by default; see
  ``backends.routing``) among the *eligible* replicas — answered the last health probe, circuit
  breaker not open, not inside an upstream ``Retry-After``, passing the pool's ``filters`` and the
  call's ``where`` — and ``release`` reports how the call ended (``Outcome``), which drives each
  replica's circuit breaker, the retry budget, load and session statistics. Health is active too: a
  background probe (the backend's ``probe``; the chat backend's is ``GET {base}/models``) runs once
  when the pool starts and then every ``interval`` seconds.
- When no replica is eligible, a call still goes out to one that passes the filters (the breakers
  and probes ignored, as Envoy's "panic threshold" routes to every host when too few are healthy):
  a recovered server is used before the next probe, and ``RetryBudget`` keeps the retries of such
  calls from multiplying the load. Only when no replica passes the filters does ``pick`` fail.
- ``Limiter``: at most ``limit`` calls in flight and ``max_queue`` waiting; beyond that
  ``OverloadedError`` (429 with ``retry_after``), so overload turns into back-pressure instead of
  unbounded memory and latency.
- ``backoff_delay``: exponential backoff with jitter, honouring an upstream ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from gymserve.backends.routing import CircuitBreaker, RetryBudget, RoutingPolicy, SessionTable, policy_for
from gymserve.errors import NoReplicaError, OverloadedError

log = logging.getLogger("gymserve.backends.pool")

MAX_BACKOFF = 8.0


class Outcome(enum.Enum):
    """How a call routed by ``ReplicaPool.pick`` ended (``ReplicaPool.release``)."""

    OK = "ok"  # answered: the breaker closes, the retry budget gets a deposit, usage feeds the estimate
    REJECTED = "rejected"  # answered with a client error (4xx, context overflow): the replica works
    FAILED = "failed"  # 5xx, timeout, an unreadable answer: one more consecutive failure for the breaker
    DOWN = "down"  # connection refused or reset, a Ray actor that died: the breaker opens now
    THROTTLED = "throttled"  # 429: no calls to this replica until its Retry-After has passed
    CANCELLED = "cancelled"  # the client went away: no verdict on the replica


@dataclass
class ReplicaStats:
    """Counters of one replica since start-up (``/metrics``, ``/health``).

    ``routed``: calls sent; ``failures``: calls that ended FAILED or DOWN; ``moves_in``: sessions
    moved here from another replica; ``later_turns``: answered turns of sessions after their first;
    ``affinity_hits``: those answered where the session's previous turn was; ``prompt_tokens`` /
    ``estimated_cached_tokens``: the prefix-hit estimate (``routing.sessions``);
    ``streams_incomplete``: streams that ended without their API's terminal event (``caller.StreamEnd``).
    """

    routed: int = 0
    failures: int = 0
    moves_in: int = 0
    later_turns: int = 0
    affinity_hits: int = 0
    prompt_tokens: int = 0
    estimated_cached_tokens: int = 0
    streams_incomplete: int = 0

    @property
    def prefix_hit_estimate(self) -> float | None:
        """``estimated_cached_tokens / prompt_tokens`` (None before any answered prompt)."""
        return self.estimated_cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(eq=False)
class Replica:
    """One upstream server. ``client`` is its SDK client (or Ray actor handle); ``probe_ok``: the
    last active probe's verdict (True before the first); ``last_error`` says why it is unhealthy;
    ``last_probe_at``: when the last probe of it ended (Unix seconds; None before the first);
    ``in_flight``: calls picked and not yet released; ``sessions`` / ``active_sessions``: sessions
    whose turns go here (all remembered / seen within the idle timeout); ``throttled_until``:
    monotonic time before which an upstream 429 asked for no calls; ``breaker``: its circuit
    breaker (set up by the pool from the routing config)."""

    base_url: str
    client: Any = None
    probe_ok: bool = True
    last_error: str | None = None
    in_flight: int = 0
    sessions: int = 0
    active_sessions: int = 0
    last_probe_at: float | None = None
    throttled_until: float = 0.0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    stats: ReplicaStats = field(default_factory=ReplicaStats)

    @property
    def healthy(self) -> bool:
        """Up as far as the pool knows: the last probe answered and the breaker is not open."""
        return self.probe_ok and self.breaker.state != "open"


R = TypeVar("R", bound=Replica)
Filter = Callable[[Any], bool]


class ReplicaPool(Generic[R]):
    """Routes calls across ``replicas``; see the module docstring.

    ``probe(replica)`` must raise when the replica is down, its message saying why (called for every
    replica once when ``start()`` runs inside an event loop, then every ``interval`` seconds;
    ``interval == 0`` disables probing). ``routing``: a ``gymserve.config.RoutingConfig`` (None: its
    defaults): the policy, the rebalance thresholds, the session table's bounds, the breaker and the
    retry budget. ``clock``: monotonic seconds; by default the running event loop's clock
    (``loop_time``), which is what ``asyncio.sleep`` and timeouts count in too.
    Generic in the replica type, so a backend gets its own ``Replica`` subclass back from ``pick``.

    ``filters``: predicates every picked replica must pass, for whoever needs to take replicas out
    of rotation for a while (e.g. while they load new weights); ``pick(where=...)`` adds one for a
    single call (e.g. "a replica on the weight version this rollout started on"). Neither is ever
    relaxed: a call that no replica can take fails (``NoReplicaError``, code ``no_replica``).
    """

    def __init__(
        self,
        replicas: list[R],
        *,
        probe: Callable[[R], Awaitable[Any]] | None = None,
        interval: float = 10.0,
        routing: Any = None,
        clock: Callable[[], float] | None = None,
    ):
        if not replicas:
            raise ValueError("a replica pool needs at least one replica")
        if routing is None:
            from gymserve.config import RoutingConfig

            routing = RoutingConfig()
        self.replicas = replicas
        self.routing = routing
        self._probe = probe
        self._interval = interval
        self._clock = clock = clock or loop_time
        for r in replicas:
            r.breaker = CircuitBreaker(routing.breaker_failures, routing.breaker_cooldown, clock=clock)
        self.policy: RoutingPolicy[R] = policy_for(routing.policy, replicas, routing)
        self.sessions = SessionTable(max_sessions=routing.max_sessions, idle_timeout=routing.session_idle_timeout)
        self.retry_budget = RetryBudget(
            routing.retry_budget_ratio, routing.retry_budget_min_per_s, routing.retry_budget_window, clock=clock
        )
        self.filters: list[Filter] = []
        # Called with a replica that comes back (unhealthy → healthy: a probe answers again, its
        # breaker closes, mark_up): it may have restarted, so what was known of it may be stale.
        self.on_recover: list[Callable[[R], None]] = []
        self.panics = 0  # picks made with no eligible replica
        self._task: asyncio.Task | None = None
        self._first_round = asyncio.Event()  # set when every replica has been probed once

    # ---- routing -------------------------------------------------------------------------------

    def _usable(self, r: R, now: float) -> bool:
        return r.probe_ok and r.breaker.allows() and r.throttled_until <= now

    def _allowed(self, r: R, where: Filter | None) -> bool:
        return (where is None or where(r)) and all(f(r) for f in self.filters)

    def pick(self, session_id: str | None = None, *, exclude: Collection[R] = (), where: Filter | None = None) -> R:
        """The replica for this call, counted as in flight there until ``release``.

        A session's turn stays on its replica when the policy keeps it there (``stay``); otherwise
        the policy places the call among the eligible replicas that are not in ``exclude`` (those
        that already failed this call), then among the eligible ones, then — none eligible — among
        all that pass the filters. Raises ``NoReplicaError`` (code ``no_replica``) when no
        replica passes ``filters`` and ``where``. Every pick must be followed by one ``release``.
        """
        self.start()
        now = self._clock()
        self.sessions.expire(now)
        home = cast("R | None", self.sessions.home(session_id) if session_id is not None else None)

        def eligible(r: R) -> bool:
            return self._usable(r, now) and r not in exclude and self._allowed(r, where)

        chosen: R | None
        if home is not None and eligible(home) and self.policy.stay(home, eligible):
            chosen = home
        else:
            chosen = self.policy.place(eligible, session_id)
            if chosen is None and exclude:
                chosen = self.policy.place(lambda r: self._usable(r, now) and self._allowed(r, where), session_id)
            if chosen is None:
                # Panic: none is usable. Breakers and probes are ignored, a Retry-After never is: a
                # replica not inside one first, else the one whose Retry-After ends first (the
                # caller waits for it, ``throttle_wait``).
                chosen = self.policy.place(lambda r: self._allowed(r, where) and r.throttled_until <= now, session_id)
                if chosen is None:
                    allowed = [r for r in self.replicas if self._allowed(r, where)]
                    if not allowed:
                        raise NoReplicaError(
                            f"no replica can take this call: none of the {len(self.replicas)} replicas passes the "
                            "routing filters (e.g. every replica is loading new weights); retry once they are back"
                        )
                    chosen = min(allowed, key=lambda r: r.throttled_until)
                self.panics += 1
                log.warning("no healthy replica; sending the call to %s anyway", chosen.base_url)
        chosen.in_flight += 1
        chosen.stats.routed += 1
        chosen.breaker.on_pick()
        # A retry that leaves a home replica which failed this call once but is still healthy (its
        # breaker not open: one transient 5xx is below ``breaker_failures``) does not move the
        # session: its next turn goes home, where its prefix is cached.
        keep_home = home is not None and home in exclude and home.healthy and chosen is not home
        if session_id is not None and not keep_home and self.sessions.route(session_id, chosen, now):
            chosen.stats.moves_in += 1
            if home is not None and not home.healthy:
                log.info("session %s moves off unhealthy replica %s to %s", session_id, home.base_url, chosen.base_url)
        return chosen

    def release(
        self,
        replica: R,
        outcome: Outcome,
        *,
        session_id: str | None = None,
        usage: tuple[int, int] | None = None,
        reason: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        """End a call picked on ``replica``. ``usage``: ``(prompt_tokens, completion_tokens)`` of an
        OK answer to ``session_id``'s turn (feeds the prefix-hit estimate); ``reason``: why it failed
        (shown as the replica's ``last_error``); ``retry_after``: seconds a THROTTLED replica asked
        for (1 s when it named none)."""
        replica.in_flight -= 1
        breaker = replica.breaker
        if outcome is Outcome.OK or outcome is Outcome.REJECTED:
            closed_before = breaker.state == "closed"  # an open or half-open breaker: it was out
            breaker.success()
            self._recovered(replica, closed_before)
            if outcome is Outcome.OK:
                self.retry_budget.deposit()
                if replica.probe_ok:
                    replica.last_error = None
                if session_id is not None and usage is not None:
                    self.sessions.answered(session_id, replica, *usage)
        elif outcome is Outcome.FAILED or outcome is Outcome.DOWN:
            replica.stats.failures += 1
            replica.last_error = reason
            was = breaker.state
            (breaker.trip if outcome is Outcome.DOWN else breaker.failure)(reason or outcome.value)
            if was != "open" and breaker.state == "open":
                log.warning(
                    "replica %s: circuit breaker open for %.3g s after %s",
                    replica.base_url,
                    breaker.current_cooldown,
                    reason,
                )
        elif outcome is Outcome.THROTTLED:
            breaker.cancelled()
            wait = retry_after if retry_after is not None and retry_after > 0 else 1.0
            replica.throttled_until = max(replica.throttled_until, self._clock() + min(wait, 60.0))
        else:
            breaker.cancelled()

    def throttle_wait(self, replica: R) -> float:
        """Seconds until ``replica``'s upstream ``Retry-After`` has passed (0 when it is not throttled)."""
        return max(0.0, replica.throttled_until - self._clock())

    def mark_down(self, replica: R, reason: str) -> None:
        """Take ``replica`` out of rotation now (its breaker opens; ``reason`` becomes ``last_error``)."""
        if replica.healthy:
            log.warning("replica %s marked unhealthy: %s", replica.base_url, reason)
        replica.breaker.trip(reason)
        replica.last_error = reason

    def mark_up(self, replica: R) -> None:
        """Put ``replica`` back (breaker closed, probe verdict good)."""
        was = replica.healthy
        if not was:
            log.info("replica %s is healthy again", replica.base_url)
        replica.breaker.reset()
        replica.probe_ok, replica.last_error = True, None
        self._recovered(replica, was)

    def _recovered(self, replica: R, was_healthy: bool) -> None:
        """Run the ``on_recover`` hooks when ``replica`` went from unhealthy to healthy."""
        if was_healthy or not replica.healthy:
            return
        for hook in self.on_recover:
            hook(replica)

    # ---- active health -------------------------------------------------------------------------

    async def check_all(self) -> None:
        """Probe every replica once, updating health."""
        probe = self._probe
        if probe is None:
            return

        async def one(replica: R) -> None:
            healthy_before = replica.healthy
            try:
                await probe(replica)
            except Exception as exc:  # any failure means "not usable now"
                if replica.probe_ok:
                    log.warning("replica %s failed its health probe: %s", replica.base_url, exc)
                replica.probe_ok = False
                replica.last_error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            else:
                if not replica.probe_ok:
                    log.info("replica %s answers its health probe again", replica.base_url)
                replica.probe_ok = True
                replica.breaker.probe_answered()
                if replica.breaker.state == "closed":
                    replica.last_error = None
            finally:
                replica.last_probe_at = time.time()
            self._recovered(replica, healthy_before)

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
            started = self._clock()
            try:
                await self.check_all()
            finally:
                self._first_round.set()
            # Rounds start every interval (not interval after a slow probe), so a change is seen
            # within one interval plus one probe.
            await asyncio.sleep(max(0.0, self._interval - (self._clock() - started)))

    # ---- what it reports -----------------------------------------------------------------------

    def replica_row(self, r: R) -> dict[str, Any]:
        """One replica's routing state for ``/health``: health, breaker, load, sessions, statistics."""
        s = r.stats
        hit = s.prefix_hit_estimate
        return {
            "healthy": r.healthy,
            "breaker": r.breaker.state,
            "breaker_opens": r.breaker.opens,
            "in_flight": r.in_flight,
            "sessions": r.sessions,
            "active_sessions": r.active_sessions,
            "routed": s.routed,
            "failures": s.failures,
            "session_moves_in": s.moves_in,
            "affinity_hits": s.affinity_hits,
            "later_turns": s.later_turns,
            "prompt_tokens": s.prompt_tokens,
            "estimated_cached_tokens": s.estimated_cached_tokens,
            "prefix_hit_estimate": round(hit, 4) if hit is not None else None,
            "streams_incomplete": s.streams_incomplete,
        }

    def status(self) -> dict[str, Any]:
        """``{"status": ok|degraded|down, "probe_interval_s", "routing", "retry_budget", "replicas":
        [{base_url, healthy, last_probe_at, last_error, breaker, in_flight, sessions, ...}]}`` for
        ``/health``; ``last_probe_at`` is Unix seconds (None before the first probe;
        ``probe_interval_s`` 0: no background probe); ``healthy``: probe answered and breaker not open."""
        up = sum(r.healthy for r in self.replicas)
        state = "ok" if up == len(self.replicas) else "degraded" if up else "down"
        budget = self.retry_budget
        return {
            "status": state,
            "probe_interval_s": self._interval if self.probing else 0,
            "routing": self.policy.name,
            "retry_budget": {"balance": round(budget.balance, 2), "retries": budget.retries, "denied": budget.denied},
            "replicas": [
                {
                    "base_url": r.base_url,
                    "last_probe_at": round(r.last_probe_at, 3) if r.last_probe_at is not None else None,
                    "last_error": r.last_error,
                    **self.replica_row(r),
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


def loop_time() -> float:
    """The running event loop's clock (``loop.time()``: ``time.monotonic()`` for asyncio's own
    loops), else ``time.monotonic()``: the time base of ``asyncio.sleep`` and ``asyncio.timeout``,
    so breaker cool-downs and budget windows follow the same clock as backoffs (and a simulation
    that runs the loop on virtual time, ``bench/fleet.py``, drives them all)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def backoff_delay(attempt: int, initial: float, retry_after: float | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): ``initial * 2**attempt`` capped at 8 s,
    minus up to 25 % jitter (as the openai SDK does); an upstream Retry-After up to 60 s wins."""
    if retry_after is not None and 0 < retry_after <= 60:
        return retry_after
    return min(initial * (2**attempt), MAX_BACKOFF) * (1 - 0.25 * random.random())


def usage_of(answer: Any) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from a chat completion's or a Response's ``usage``
    (None when it has none)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    tin = usage.get("prompt_tokens", usage.get("input_tokens"))
    tout = usage.get("completion_tokens", usage.get("output_tokens"))
    return (tin, tout) if isinstance(tin, int) and isinstance(tout, int) else None
