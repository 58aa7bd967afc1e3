"""Prometheus metrics for ``GET /metrics``: model calls, errors, latency and tokens per route,
backend and replica, queue depth and in-flight requests, and each replica's routing state (load,
health, circuit breaker, sessions, prefix-hit estimate) with the retry budget.

Each app has its own ``CollectorRegistry`` (several servers in one process, as in tests, do not
clash). The hot path costs a few dictionary look-ups and lock-protected additions per request:
label children are cached by their label tuple, so ``prometheus_client``'s label validation runs
once per distinct (route, backend, replica) rather than once per request.

Labels are bounded: ``route`` is one of the served routes, ``backend`` the backend's name and
``replica`` a configured replica (a base URL with credentials removed, ``local``, or a Ray replica
name). Nothing from a request body or header becomes a label, and no label or value carries an
API key (see ``test_security.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def usage_tokens(result: Any) -> tuple[int, int]:
    """``(tokens in, tokens out)`` from a chat completion's, a Response's or an Anthropic Message's
    ``usage`` (0 if absent); a Message's prompt is ``input_tokens`` plus its cache reads and writes
    (Anthropic: "total input tokens is the sum of input_tokens, cache_creation_input_tokens and
    cache_read_input_tokens")."""
    usage = result.get("usage") if isinstance(result, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    tin = usage.get("prompt_tokens", usage.get("input_tokens"))
    tout = usage.get("completion_tokens", usage.get("output_tokens"))
    tin = tin if isinstance(tin, int) else 0
    for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):
        if isinstance(usage.get(cached), int):
            tin += usage[cached]
    return tin, (tout if isinstance(tout, int) else 0)


class _QueueCollector:
    """Reads queue depth and running calls from the backend's ``Limiter`` at scrape time."""

    def __init__(self, backend_name: str, limiter_of: Callable[[], Any]):
        self.backend_name, self.limiter_of = backend_name, limiter_of

    def collect(self):
        limiter = self.limiter_of()
        waiting = GaugeMetricFamily(
            "gymserve_backend_queued_requests",
            "Requests waiting for a backend slot (bounded by server.max_queue)",
            labels=["backend"],
        )
        running = GaugeMetricFamily(
            "gymserve_backend_running_requests", "Requests holding a backend slot", labels=["backend"]
        )
        if limiter is not None:
            waiting.add_metric([self.backend_name], getattr(limiter, "waiting", 0))
            running.add_metric([self.backend_name], getattr(limiter, "running", 0))
        yield waiting
        yield running

    def describe(self):
        return []


class _ReplicaCollector:
    """Reads each replica's routing state from the backend's ``ReplicaPool`` at scrape time: load,
    health, circuit breaker, sessions, routing counters, the prefix-hit estimate, and the pool's
    retry budget (``backends.pool``; docs/model-servers/vllm.md lists the series)."""

    GAUGES = (
        ("in_flight", "gymserve_replica_in_flight", "Calls routed to the replica and not yet answered"),
        ("sessions", "gymserve_replica_sessions", "Sessions whose turns go to the replica (the affinity table)"),
        ("active_sessions", "gymserve_replica_active_sessions", "Of those, sessions with a call in the idle timeout"),
        (
            "healthy",
            "gymserve_replica_healthy",
            "1 when the replica answered its last probe and its breaker is not open",
        ),
    )
    COUNTERS = (
        ("routed", "gymserve_replica_routed", "Calls routed to the replica"),
        ("failures", "gymserve_replica_failures", "Calls that failed on the replica (5xx, timeout, unreachable)"),
        ("session_moves_in", "gymserve_replica_session_moves", "Sessions moved to the replica from another one"),
        ("later_turns", "gymserve_replica_later_turns", "Answered turns of sessions after their first"),
        ("affinity_hits", "gymserve_replica_affinity_hits", "Of those, turns answered where the previous turn was"),
        ("prompt_tokens", "gymserve_replica_prompt_tokens", "Prompt tokens of answered session turns"),
        (
            "estimated_cached_tokens",
            "gymserve_replica_estimated_cached_tokens",
            "Of those, tokens the replica computed for the previous turn (the prefix-hit estimate)",
        ),
        ("breaker_opens", "gymserve_replica_breaker_opens", "Times the replica's circuit breaker opened"),
        (
            "streams_incomplete",
            "gymserve_replica_streams_incomplete",
            "Streams from the replica that ended without their terminal event (finish_reason, "
            "response.completed, message_stop): answered 502 stream_incomplete",
        ),
    )

    def __init__(self, backend_name: str, pool_of: Callable[[], Any], label_of: Callable[[Any], str]):
        self.backend_name, self.pool_of, self.label_of = backend_name, pool_of, label_of

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        pool = self.pool_of()
        labels = ["backend", "replica"]
        gauges = {k: GaugeMetricFamily(name, doc, labels=labels) for k, name, doc in self.GAUGES}
        counters = {k: CounterMetricFamily(name, doc, labels=labels) for k, name, doc in self.COUNTERS}
        breaker = GaugeMetricFamily(
            "gymserve_replica_breaker_state",
            "1 for the replica's circuit-breaker state (closed, open, half_open), 0 for the others",
            labels=[*labels, "state"],
        )
        hit = GaugeMetricFamily(
            "gymserve_replica_prefix_hit_estimate",
            "estimated_cached_tokens / prompt_tokens of the replica (a router-side estimate; the engine's own "
            "prefix-cache counters are the measurement)",
            labels=labels,
        )
        budget = GaugeMetricFamily(
            "gymserve_retry_budget_balance", "Retries the backend's retry budget allows now", labels=["backend"]
        )
        retries = CounterMetricFamily("gymserve_retries", "Retries taken from the retry budget", labels=["backend"])
        denied = CounterMetricFamily(
            "gymserve_retries_denied", "Retries the retry budget refused (the call failed instead)", labels=["backend"]
        )
        if pool is not None:
            name = self.backend_name
            for r in pool.replicas:
                row = pool.replica_row(r)
                who = [name, self.label_of(r)]
                for key, _, _ in self.GAUGES:
                    gauges[key].add_metric(who, float(row[key]))
                for key, _, _ in self.COUNTERS:
                    counters[key].add_metric(who, row[key])
                for state in ("closed", "open", "half_open"):
                    breaker.add_metric([*who, state], 1.0 if row["breaker"] == state else 0.0)
                if row["prefix_hit_estimate"] is not None:
                    hit.add_metric(who, row["prefix_hit_estimate"])
            b = pool.retry_budget
            budget.add_metric([name], b.balance)
            retries.add_metric([name], b.retries)
            denied.add_metric([name], b.denied)
        yield from gauges.values()
        yield from counters.values()
        yield from (breaker, hit, budget, retries, denied)

    def describe(self):
        return []


class Metrics:
    """The server's metrics; ``observe`` records one finished model call."""

    def __init__(self, backend: Any = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gymserve_requests",
            "Model calls answered, by route, backend, replica and HTTP status",
            ["route", "backend", "replica", "status"],
            registry=r,
        )
        self.errors = Counter(
            "gymserve_request_errors",
            "Model calls that failed, by error type",
            ["route", "backend", "replica", "type"],
            registry=r,
        )
        self.latency = Histogram(
            "gymserve_request_latency_seconds",
            "Model call latency (whole stream for streams)",
            ["route", "backend", "replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "gymserve_tokens", "Tokens in (prompt) and out (generated)", ["direction", "backend", "replica"], registry=r
        )
        self.in_flight = Gauge("gymserve_requests_in_flight", "Model calls being served", ["route"], registry=r)
        self.auth_failures = Counter(
            "gymserve_auth_failures", "Requests refused for a missing or wrong API key", registry=r
        )
        self.capture_dropped = Counter(
            "gymserve_capture_dropped", "Capture records dropped (writer queue full)", registry=r
        )
        self._children: dict[tuple, tuple] = {}
        self._errors: dict[tuple, Any] = {}
        self._in_flight: dict[str, Any] = {}
        if backend is not None:
            r.register(_QueueCollector(backend.name, lambda: backend.limiter))
            r.register(_ReplicaCollector(backend.name, lambda: backend.pool, _replica_label))

    def _child(self, route: str, backend: str, replica: str, status: int):
        key = (route, backend, replica, status)
        got = self._children.get(key)
        if got is None:
            got = (
                self.requests.labels(route, backend, replica, str(status)),
                self.latency.labels(route, backend, replica),
                self.tokens.labels("in", backend, replica),
                self.tokens.labels("out", backend, replica),
            )
            self._children[key] = got
        return got

    def gauge(self, route: str):
        g = self._in_flight.get(route)
        if g is None:
            g = self._in_flight[route] = self.in_flight.labels(route)
        return g

    def observe(
        self,
        route: str,
        backend: str,
        replica: str,
        status: int,
        seconds: float,
        tokens: tuple[int, int] = (0, 0),
        error_type: str | None = None,
    ) -> None:
        req, lat, tin, tout = self._child(route, backend, replica, status)
        req.inc()
        lat.observe(seconds)
        if tokens[0]:
            tin.inc(tokens[0])
        if tokens[1]:
            tout.inc(tokens[1])
        if error_type is not None:
            key = (route, backend, replica, error_type)
            err = self._errors.get(key)
            if err is None:
                err = self._errors[key] = self.errors.labels(*key)
            err.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _replica_label(replica: Any) -> str:
    """A replica's ``replica`` label: a Ray replica's name, else its base URL without credentials
    (the label the request series use, ``caller.replica_label``)."""
    name = getattr(replica, "name", None)
    if isinstance(name, str):
        return name
    from gymserve.backends.caller import replica_label

    return replica_label(replica.base_url)
