"""``UpstreamCaller``: the one way a remote backend calls its upstream.

It owns the replicas (``pool.ReplicaPool``: the routing policy, session affinity, circuit breakers,
the retry budget, a probe of ``GET {base}/models`` at start-up and every ``health_check_interval``
s), the concurrency limit (``pool.Limiter``: ``num_concurrent_requests`` in flight, ``max_queue``
waiting, 429 beyond), retries and error translation. Each call is routed by ``pool.pick`` and
reported by ``release`` with what its outcome says about the replica (``outcome_of``). A retryable
failure — a connection failure, a 5xx, a 429 (``GymserveError.retryable``; a timeout, a 4xx and a
context-window overflow are not) — is retried at most ``max_retries`` times and only while the
pool's retry budget allows: on another replica at once when one is eligible, else on the same one
after an exponential backoff with jitter (an upstream ``Retry-After`` wins). The session ID goes
upstream as ``X-Session-ID`` (``Upstream.session_header``). Every failure leaves as a
``GymserveError`` from ``upstream_errors.translate_error``, naming the URL tried (credentials removed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import AsyncGenerator
from typing import Any

from gymserve.backends.base import RequestContext
from gymserve.backends.pool import Limiter, Outcome, Replica, ReplicaPool, backoff_delay, usage_of
from gymserve.backends.stream_end import StreamEnd
from gymserve.backends.upstream import Upstream
from gymserve.backends.upstream_errors import is_retryable, translate_error
from gymserve.errors import (
    ContextLengthExceededError,
    GymserveError,
    UpstreamBadResponseError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamRateLimitedError,
    UpstreamRejectedError,
    UpstreamStreamIncompleteError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gymserve.redaction import redact_url

log = logging.getLogger("gymserve.backends")


class UpstreamCaller:
    """Calls ``upstream`` (an ``upstream.Upstream``); see the module docstring. ``max_queue``
    bounds the requests waiting for a slot of ``limiter``."""

    def __init__(self, upstream: Upstream, *, max_queue: int):
        self.upstream = upstream
        self.config = upstream.config
        replicas = [Replica(base, upstream.transport(base)) for base in upstream.bases()]
        self.pool = ReplicaPool(
            replicas,
            probe=self._probe,
            interval=upstream.health_interval,
            routing=getattr(self.config, "routing", None),
        )
        # Built inside the serving loop (server.run), this probes every replica now, so /health
        # is true from start-up; built outside a loop, the first request or /health starts it.
        self.pool.start()
        self.limiter = Limiter(self.config.num_concurrent_requests, max_queue, name=f"{upstream.kind} backend")

    def url(self, replica: Replica, kind: str) -> str:
        """The URL of ``kind`` on ``replica`` (``Upstream.url``)."""
        return self.upstream.url(replica.base_url, kind)

    def translate(self, exc: BaseException, url: str, kind: str) -> GymserveError:
        """The ``GymserveError`` explaining ``exc`` raised while calling ``url``."""
        up = self.upstream
        return translate_error(
            exc,
            url=url,
            kind=kind,
            backend=up.kind,
            secrets=up.secrets,
            api_version=up.api_version,
            timeout=self.config.timeout,
        )

    @property
    def probe_timeout(self) -> float:
        """Seconds one probe (and the wait for the first round of them) may take."""
        return min(5.0, self.config.timeout)

    async def _probe(self, replica: Replica) -> None:
        """``GET {base}/models``: the one route every OpenAI-compatible server answers under the same
        base URL, key and proxy as the model calls (``/health`` sits at a server-specific place
        outside the base URL, or nowhere, and checks no key). Raises the translated error."""
        url = self.url(replica, "models")
        try:
            async with asyncio.timeout(self.probe_timeout):
                await replica.client.get(url, timeout=self.probe_timeout)
        except Exception as exc:
            raise translate_error(
                exc,
                url=url,
                kind="models",
                backend=self.upstream.kind,
                secrets=self.upstream.secrets,
                api_version=self.upstream.api_version,
                timeout=self.probe_timeout,
            ) from None

    def _headers(self, ctx: RequestContext) -> dict[str, str] | None:
        """``X-Session-ID`` for the upstream when the call belongs to a session and the upstream
        wants it (``Upstream.session_header``), so a router behind gymserve can keep it together too."""
        if ctx.session_id and self.upstream.session_header:
            return {"X-Session-ID": ctx.session_id}
        return None

    def release(
        self, rep: Replica, ctx: RequestContext, error: GymserveError | None, answer: Any = None, *, routed: bool
    ) -> None:
        """Report to the pool how a call to ``rep`` ended: ``error`` (None: answered, with ``answer``
        the parsed body whose ``usage`` feeds the prefix-hit estimate). ``routed``: the call was
        routed for its session (not pinned to a replica, like a ``/tokenize`` after a chat call)."""
        session = ctx.session_id if routed else None
        if error is None:
            self.pool.release(rep, Outcome.OK, session_id=session, usage=usage_of(answer))
            return
        retry_after = error.upstream_retry_after if isinstance(error, UpstreamRateLimitedError) else None
        self.pool.release(rep, outcome_of(error), reason=error.message, retry_after=retry_after)

    async def call(
        self,
        kind: str,
        body: dict[str, Any] | None,
        ctx: RequestContext,
        *,
        stream: bool = False,
        replica: Replica | None = None,
        url: str | None = None,
    ) -> tuple[Any, Replica]:
        """POST ``body`` (GET when None) to the ``kind`` URL of a replica (``replica``, else the one
        the pool picks for the session; ``url`` overrides the URL). Returns ``(parsed JSON object or
        SDK stream, replica)``; raises the translated ``GymserveError`` once retries are spent.

        A stream is returned as soon as its headers arrive and stays counted as in flight on its
        replica: the caller reads it through ``events``, which releases it however it ends.
        Retries: at most ``max_retries`` per call, each also taken from the pool's retry budget; a
        retry goes to another replica at once when one is eligible, else to the same one after an
        exponential backoff with jitter (an upstream ``Retry-After`` wins).
        """
        attempt = 0
        tried: list[Replica] = []
        said: list[tuple[str, GymserveError]] = []  # (URL tried, what it answered), for the final error
        headers = self._headers(ctx)
        # At start-up, choose among replicas known to answer (bounded: a hanging one costs one probe timeout).
        await self.pool.first_probe(self.probe_timeout)
        rep = replica or self.pool.pick(ctx.session_id, exclude=tried)
        if replica is not None:
            self._pin(replica)
        while True:
            target = url or self.url(rep, kind)
            ctx.extra["replica"] = replica_label(rep.base_url)
            await self._await_retry_after(rep, said)
            try:
                # httpx's timeout bounds each read, not the whole answer: an upstream that trickles
                # a byte at a time would never time out. The deadline bounds the whole call (for
                # streams: until the headers arrive; each chunk is then bounded by the read timeout).
                async with asyncio.timeout(self.config.timeout):
                    if body is None:
                        result = await rep.client.get(target)
                    elif stream:
                        result = await rep.client.stream(target, body, headers=headers)
                    else:
                        result = await rep.client.post(target, body, headers=headers)
                if not stream and not isinstance(result, dict):
                    raise UpstreamBadResponseError(
                        f"{redact_url(target)} answered with something that is not a JSON object "
                        f"({str(result)[:120]!r}); is the base URL an OpenAI-compatible API?",
                        url=redact_url(target),
                    )
            except asyncio.CancelledError:
                self.pool.release(rep, Outcome.CANCELLED)
                raise
            except Exception as exc:
                err = self.translate(exc, target, kind)
                self.release(rep, ctx, err, routed=replica is None)
                said.append((redact_url(target), err))
                if attempt >= self.config.max_retries or not is_retryable(err):
                    raise with_attempts(err, said) from None
                if not self.pool.retry_budget.try_withdraw():
                    log.warning("not retrying %s: the retry budget is spent (%s)", redact_url(target), err.message)
                    raise with_attempts(err, said) from None
                attempt += 1
                tried.append(rep)
                failed = rep
                if replica is None:
                    rep = self.pool.pick(ctx.session_id, exclude=tried)
                else:
                    self._pin(replica)
                # Another replica: go now (the failed one is out of rotation). The same one: back off;
                # after a 429 the wait is its Retry-After, which the next turn of the loop awaits
                # (``_await_retry_after``: bounded, and for whichever replica is picked).
                delay = 0.0
                if rep is failed and not isinstance(err, UpstreamRateLimitedError):
                    delay = backoff_delay(attempt - 1, self.config.retry_backoff)
                log.warning(
                    "retry %d/%d of %s on %s in %.2f s: %s",
                    attempt,
                    self.config.max_retries,
                    redact_url(target),
                    replica_label(rep.base_url),
                    delay,
                    err.message,
                )
                if delay:
                    try:
                        await asyncio.sleep(delay)
                    except asyncio.CancelledError:
                        self.pool.release(rep, Outcome.CANCELLED)
                        raise
                continue
            if not stream:
                self.release(rep, ctx, None, result, routed=replica is None)
            return result, rep

    async def _await_retry_after(self, rep: Replica, said: list[tuple[str, GymserveError]]) -> None:
        """Never call a replica inside its upstream ``Retry-After``: wait until it has passed when
        that is within the backend's ``timeout`` (the wait a call accepts anyway), else release
        ``rep`` and raise ``UpstreamRateLimitedError`` (429) whose ``Retry-After`` is the earliest
        moment any replica takes calls again, naming every upstream tried and what each said."""
        wait = self.pool.throttle_wait(rep)
        if wait <= 0:
            return
        if wait > self.config.timeout:
            self.pool.release(rep, Outcome.CANCELLED)
            earliest = min(self.pool.throttle_wait(r) for r in self.pool.replicas)
            err = UpstreamRateLimitedError(
                f"every replica is rate limiting: the earliest Retry-After ends in {earliest:.1f} s, longer than "
                f"the backend timeout ({self.config.timeout:g} s); retry after it",
                upstream_retry_after=max(1.0, math.ceil(earliest)),
            )
            raise with_attempts(err, said) from None
        log.info("waiting %.2f s for the Retry-After of %s", wait, replica_label(rep.base_url))
        try:
            await asyncio.sleep(wait)
        except asyncio.CancelledError:
            self.pool.release(rep, Outcome.CANCELLED)
            raise

    def _pin(self, replica: Replica) -> None:
        """Count a call to a given replica (not chosen by the pool) as in flight there."""
        replica.in_flight += 1
        replica.stats.routed += 1

    async def events(
        self, stream: Any, replica: Replica, kind: str, ctx: RequestContext, *, require_events: bool = True
    ) -> AsyncGenerator[Any, None]:
        """The events of an upstream ``stream`` (from ``call(..., stream=True)``) on ``replica``,
        which this owns from then on: a failure leaves translated (``translate``); an empty stream
        raises ``UpstreamBadResponseError`` when ``require_events``; the stream is closed however
        the iteration ends, and the pool hears how it ended (``release``: read to its end, failed,
        or cancelled when the client went away), with the last ``usage`` seen (a chunk's, or a
        Responses event's ``response``) for the prefix-hit estimate."""
        url = self.url(replica, kind)
        got = done = False
        error: GymserveError | None = None
        usage: Any = None
        end = StreamEnd(kind)
        try:
            async for event in stream:
                got = True
                if isinstance(event, dict):
                    end.see(event)
                    if isinstance(event.get("usage"), dict):
                        usage = event
                    elif isinstance(event.get("response"), dict) and isinstance(event["response"].get("usage"), dict):
                        usage = event["response"]
                yield event
            where = redact_url(url)
            if require_events and not got:
                raise UpstreamBadResponseError(
                    f"{where} answered a streaming request without any events (not server-sent events, or an "
                    "empty stream); does the server support stream=true?",
                    url=where,
                )
            if not end.complete:
                replica.stats.streams_incomplete += 1
                log.warning("stream from %s ended without %s", where, end.expected)
                raise UpstreamStreamIncompleteError(
                    f"{where} ended the stream without {end.expected}: the answer was cut short (a crashed or "
                    "restarted server, or a proxy that closed the stream) and is not complete; send the call again",
                    url=where,
                )
            done = True
        except Exception as exc:
            error = exc if isinstance(exc, GymserveError) else self.translate(exc, url, kind)
            raise error from None
        finally:
            with contextlib.suppress(Exception):
                await stream.close()
            if done or error is not None:
                self.release(replica, ctx, error, usage, routed=True)
            else:
                self.pool.release(replica, Outcome.CANCELLED)

    async def close(self) -> None:
        """Stop the health probe and close every replica's clients."""
        await self.pool.close()
        for replica in self.pool.replicas:
            await replica.client.close()


def with_attempts(err: GymserveError, said: list[tuple[str, GymserveError]]) -> GymserveError:
    """``err`` with every attempt of the call listed in its message (``attempts: 1. URL: message;
    2. …``) when there was more than one, or when ``err`` is not the one answer it describes, so the
    final error names every upstream tried and what each said."""
    if len(said) < 2 and (not said or said[0][1] is err):
        return err
    listed = "; ".join(f"{i}. {where}: {e.message}" for i, (where, e) in enumerate(said, 1))
    err.message = f"{err.message} (attempts: {listed})"
    return err


@functools.lru_cache(maxsize=1024)
def replica_label(base_url: str) -> str:
    """A replica's name in metrics and capture: its base URL without credentials (``redact_url``)."""
    return redact_url(base_url)


def outcome_of(err: GymserveError) -> Outcome:
    """What a failed call says about its replica: a refused or reset connection means it is down,
    a 5xx, a timeout or an unreadable answer count toward its breaker, a 429 throttles it, and a
    4xx or a context overflow say nothing against it (another replica would answer the same)."""
    if isinstance(err, UpstreamUnreachableError):
        return Outcome.DOWN
    if isinstance(err, UpstreamRateLimitedError):
        return Outcome.THROTTLED
    if isinstance(err, (ContextLengthExceededError, UpstreamRejectedError)):
        return Outcome.REJECTED
    if isinstance(err, (UpstreamTimeoutError, UpstreamConnectionError, UpstreamError)):
        return Outcome.FAILED
    return Outcome.REJECTED
