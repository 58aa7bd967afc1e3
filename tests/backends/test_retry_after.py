"""Retries and routing as documented (issue #26, symptoms 2 and 3), against recording fakes on
127.0.0.1 that note when each call arrived:

- a replica that answered 429 with ``Retry-After`` gets no call before it has passed, even when
  every replica is throttled (the call waits, within the backend ``timeout``, or fails at once with
  429 and the earliest ``Retry-After``);
- the final error names every upstream tried and what each said;
- one transient 5xx does not move a session (the breaker needs ``breaker_failures`` of them).
"""

from __future__ import annotations

import time

import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.config import validate_config
from gymserve.errors import UpstreamConnectionError, UpstreamRateLimitedError
from helpers.fakes import ChatScript, FakeServer, free_port

MSG = [{"role": "user", "content": "hi"}]


class Throttling:
    """A chat server that answers every chat call 429 with ``Retry-After: seconds`` and records
    the monotonic time of each call."""

    def __init__(self, name: str, seconds: int):
        self.name, self.seconds, self.times = name, seconds, []

    def __call__(self, r):
        if r.path.endswith("/models"):
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]}
        self.times.append(time.monotonic())
        body = {"error": {"message": f"{self.name} is busy", "type": "rate_limit", "code": None}}
        return 429, body, {"Retry-After": str(self.seconds)}


def make(urls, **options):
    return build_backend(
        validate_config(
            {
                "backend": {
                    "type": "chat",
                    "base_urls": urls,
                    "model": "policy",
                    "retry_backoff": 0.01,
                    "health_check_interval": 0,
                    **options,
                }
            }
        )
    )


async def test_no_replica_is_called_inside_its_retry_after_when_all_are_throttled():
    a, b = Throttling("A", 1), Throttling("B", 1)
    with FakeServer(a) as sa, FakeServer(b) as sb:
        backend = make([sa.url + "/v1", sb.url + "/v1"], max_retries=3, timeout=5)
        try:
            t0 = time.monotonic()
            with pytest.raises(UpstreamRateLimitedError) as info:
                await backend.chat({"messages": MSG}, RequestContext())
            took = time.monotonic() - t0
        finally:
            await backend.close()
    assert len(a.times) + len(b.times) == 4  # the first call and its 3 retries
    for times in (a.times, b.times):
        gaps = [later - earlier for earlier, later in zip(times, times[1:])]
        assert gaps and all(gap >= 0.95 for gap in gaps), gaps  # never before its Retry-After
    assert 0.95 <= took < 4
    # The final error lists every attempt: both replicas, and what each said.
    message = info.value.message
    assert sa.url in message and sb.url in message and "A is busy" in message and "B is busy" in message
    assert "attempts: 1. " in message and "; 4. " in message and "; 5. " not in message


async def test_a_retry_after_beyond_the_timeout_fails_at_once_with_the_earliest_retry_after():
    a, b = Throttling("A", 30), Throttling("B", 20)
    with FakeServer(a) as sa, FakeServer(b) as sb:
        backend = make([sa.url + "/v1", sb.url + "/v1"], max_retries=3, timeout=2)
        try:
            t0 = time.monotonic()
            with pytest.raises(UpstreamRateLimitedError) as info:
                await backend.chat({"messages": MSG}, RequestContext())
            assert time.monotonic() - t0 < 1.5  # no waiting 20 s, no early call
            assert (len(a.times), len(b.times)) == (1, 1)
            assert info.value.status_code == 429 and 19 <= info.value.retry_after <= 20
            assert sa.url in info.value.message and sb.url in info.value.message
            # A new call while both are throttled calls neither of them.
            with pytest.raises(UpstreamRateLimitedError) as again:
                await backend.chat({"messages": MSG}, RequestContext())
            assert (len(a.times), len(b.times)) == (1, 1) and 19 <= again.value.retry_after <= 20
        finally:
            await backend.close()


async def test_the_final_error_names_every_unreachable_upstream():
    ports = [free_port(), free_port()]
    backend = make([f"http://127.0.0.1:{p}/v1" for p in ports], max_retries=1, timeout=2)
    try:
        with pytest.raises(UpstreamConnectionError) as info:
            await backend.chat({"messages": MSG}, RequestContext())
    finally:
        await backend.close()
    assert all(f"127.0.0.1:{p}" in info.value.message for p in ports), info.value.message


async def test_one_transient_5xx_does_not_move_a_session():
    scripts = [ChatScript(name="A"), ChatScript(name="B")]
    with FakeServer(scripts[0]) as sa, FakeServer(scripts[1]) as sb:
        servers = [sa, sb]
        backend = make([sa.url + "/v1", sb.url + "/v1"], max_retries=2, timeout=5)
        ctx = RequestContext(session_id="rollout-1")
        try:
            first = await backend.chat({"messages": MSG}, ctx)
            home = 0 if first["choices"][0]["message"]["content"] == "from A" else 1
            other = 1 - home
            # One 503 on the home replica: the turn is retried on the other one...
            scripts[home].plan.append((503, {"error": {"message": "warming up", "type": "server_error"}}))
            second = await backend.chat({"messages": MSG}, ctx)
            assert second["choices"][0]["message"]["content"] == f"from {'AB'[other]}"
            # ...and every later turn goes home again, where its prefix is cached.
            for _ in range(4):
                turn = await backend.chat({"messages": MSG}, ctx)
                assert turn["choices"][0]["message"]["content"] == f"from {'AB'[home]}"
        finally:
            await backend.close()
    assert len(servers[home].chat_requests()) == 6 and len(servers[other].chat_requests()) == 1
