"""``UpstreamCaller``: the one way a remote backend calls its upstream.

It owns the replicas (``pool.ReplicaPool``: session affinity, health, a probe of
``GET {base}/models`` at start-up and every ``health_check_interval`` s), the concurrency limit (``pool.Limiter``: ``num_concurrent_requests`` in
flight, ``max_queue`` waiting, 429 beyond), retries and error translation: a connection failure
marks the replica down and is retried on another one; 5xx and 429 are retried with backoff
(honouring ``Retry-After``); a timeout, a 4xx and a context-window overflow are not (the error's
class says: ``GymserveError.retryable``). Every failure leaves as a ``GymserveError`` from
``upstream_errors.translate_error``, naming the URL tried (credentials removed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from gymserve.backends.base import RequestContext
from gymserve.backends.pool import Limiter, Replica, ReplicaPool, backoff_delay
from gymserve.backends.upstream import Upstream
from gymserve.backends.upstream_errors import is_retryable, translate_error
from gymserve.errors import GymserveError, UpstreamBadResponseError, UpstreamRateLimitedError, UpstreamUnreachableError
from gymserve.redaction import redact_url

log = logging.getLogger("gymserve.backends")


class UpstreamCaller:
    """Calls ``upstream`` (an ``upstream.Upstream``); see the module docstring. ``max_queue``
    bounds the requests waiting for a slot of ``limiter``."""

    def __init__(self, upstream: Upstream, *, max_queue: int):
        self.upstream = upstream
        self.config = upstream.config
        replicas = [Replica(base, upstream.transport(base)) for base in upstream.bases()]
        self.pool = ReplicaPool(replicas, probe=self._probe, interval=upstream.health_interval)
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
        """POST ``body`` (GET when None) to the ``kind`` URL of a replica (``replica``, else the
        session's; ``url`` overrides the URL). Returns ``(parsed JSON object or SDK stream,
        replica)``; raises the translated ``GymserveError`` once retries are spent."""
        attempt = 0
        # At start-up, choose among replicas known to answer (bounded: a hanging one costs one probe timeout).
        await self.pool.first_probe(self.probe_timeout)
        while True:
            rep = replica or self.pool.pick(ctx.session_id)
            target = url or self.url(rep, kind)
            ctx.extra["replica"] = replica_label(rep.base_url)
            rep.in_flight += 1
            try:
                # httpx's timeout bounds each read, not the whole answer: an upstream that trickles
                # a byte at a time would never time out. The deadline bounds the whole call (for
                # streams: until the headers arrive; each chunk is then bounded by the read timeout).
                async with asyncio.timeout(self.config.timeout):
                    if body is None:
                        result = await rep.client.get(target)
                    elif stream:
                        result = await rep.client.stream(target, body)
                    else:
                        result = await rep.client.post(target, body)
            except Exception as exc:
                err = self.translate(exc, target, kind)
                if isinstance(err, UpstreamUnreachableError):
                    self.pool.mark_down(rep, err.message)
                if attempt >= self.config.max_retries or not is_retryable(err):
                    raise err from None
                asked = err.upstream_retry_after if isinstance(err, UpstreamRateLimitedError) else None
                delay = backoff_delay(attempt, self.config.retry_backoff, asked)
                attempt += 1
                log.warning(
                    "retry %d/%d of %s in %.2f s: %s",
                    attempt,
                    self.config.max_retries,
                    redact_url(target),
                    delay,
                    err.message,
                )
                await asyncio.sleep(delay)
                continue
            finally:
                rep.in_flight -= 1
            self.pool.mark_up(rep)
            if not stream and not isinstance(result, dict):
                raise UpstreamBadResponseError(
                    f"{redact_url(target)} answered with something that is not a JSON object "
                    f"({str(result)[:120]!r}); is the base URL an OpenAI-compatible API?",
                    url=redact_url(target),
                )
            return result, rep

    async def events(self, stream: Any, replica: Replica, kind: str) -> AsyncIterator[Any]:
        """The events of an upstream ``stream`` (from ``call(..., stream=True)``) on ``replica``:
        an empty stream raises ``UpstreamBadResponseError``, any failure leaves translated
        (``translate``), and the stream is closed however the iteration ends."""
        url = self.url(replica, kind)
        got = False
        try:
            async for event in stream:
                got = True
                yield event
            if not got:
                where = redact_url(url)
                raise UpstreamBadResponseError(
                    f"{where} answered a streaming request without any events (not server-sent events, or an "
                    "empty stream); does the server support stream=true?",
                    url=where,
                )
        except Exception as exc:
            raise self.translate(exc, url, kind) from None
        finally:
            with contextlib.suppress(Exception):
                await stream.close()

    async def close(self) -> None:
        """Stop the health probe and close every replica's clients."""
        await self.pool.close()
        for replica in self.pool.replicas:
            await replica.client.close()


@functools.lru_cache(maxsize=1024)
def replica_label(base_url: str) -> str:
    """A replica's name in metrics and capture: its base URL without credentials (``redact_url``)."""
    return redact_url(base_url)
