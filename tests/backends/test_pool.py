"""Replica choice, session affinity, health, the concurrency limiter and retry delays."""

from __future__ import annotations

import asyncio

import pytest

from gymserve.backends.pool import Limiter, Replica, ReplicaPool, backoff_delay
from gymserve.errors import OverloadedError


def pool(n=3, **kw) -> ReplicaPool:
    return ReplicaPool([Replica(f"http://r{i}/v1") for i in range(n)], **kw)


def test_sessions_round_robin_then_stick():
    p = pool()
    first = [p.pick(f"s{i}").base_url for i in range(3)]
    assert sorted(first) == ["http://r0/v1", "http://r1/v1", "http://r2/v1"]
    for _ in range(3):
        assert [p.pick(f"s{i}").base_url for i in range(3)] == first
    assert [r.sessions for r in p.replicas] == [1, 1, 1]


def test_requests_without_session_go_round_robin():
    p = pool()
    assert len({p.pick(None).base_url for _ in range(3)}) == 3


def test_unhealthy_replica_is_skipped_and_comes_back():
    p = pool(2)
    a = p.pick("a")
    p.mark_down(a, "ConnectError")
    moved = p.pick("a")
    assert moved is not a and all(p.pick(None) is moved for _ in range(4))
    assert p.status()["status"] == "degraded"
    p.mark_up(a)
    assert {p.pick(None).base_url for _ in range(4)} == {r.base_url for r in p.replicas}
    assert p.pick("a") is moved  # the session stays where it moved
    for r in p.replicas:
        p.mark_down(r, "x")
    assert p.pick(None) in p.replicas and p.status()["status"] == "down"  # still tries when all are down


async def test_background_probe_restores_health():
    down = {"http://r1/v1"}

    async def probe(replica):
        if replica.base_url in down:
            raise ConnectionError("refused")

    p = pool(2, probe=probe, interval=0.02)
    p.pick(None)  # starts the probe loop
    await asyncio.sleep(0.1)
    assert [r.healthy for r in p.replicas] == [True, False]
    down.clear()
    await asyncio.sleep(0.1)
    assert all(r.healthy for r in p.replicas)
    await p.close()


async def test_first_probe_runs_at_start_then_every_interval():
    """Health is known right after start-up, not one interval (or a failed request) later."""
    calls: list[str] = []

    async def probe(replica):
        calls.append(replica.base_url)
        if replica.base_url == "http://r1/v1":
            raise ConnectionError("refused")

    p = pool(2, probe=probe, interval=0.2)
    assert p.status()["replicas"][0]["last_probe_at"] is None
    p.start()
    await p.first_probe(timeout=5)
    status = p.status()
    assert status["status"] == "degraded" and status["probe_interval_s"] == 0.2
    down = status["replicas"][1]
    assert down["healthy"] is False and down["last_error"] == "ConnectionError: refused"
    assert all(r["last_probe_at"] is not None for r in status["replicas"])
    assert sorted(calls) == ["http://r0/v1", "http://r1/v1"]
    await asyncio.sleep(0.3)
    assert len(calls) == 4  # one more round, one interval later
    await p.close()


async def test_first_probe_wait_is_bounded_and_off_without_probing():
    async def hang(replica):
        await asyncio.sleep(30)

    p = pool(1, probe=hang, interval=10)
    t0 = asyncio.get_running_loop().time()
    await p.first_probe(timeout=0.1)
    assert asyncio.get_running_loop().time() - t0 < 1
    await p.close()
    quiet = pool(1, probe=hang, interval=0)
    await quiet.first_probe(timeout=30)  # returns at once: probing is off
    assert quiet.status()["probe_interval_s"] == 0 and quiet.status()["replicas"][0]["last_probe_at"] is None


def test_affinity_table_is_bounded():
    p = pool(2, max_sessions=10)
    for i in range(100):
        p.pick(f"s{i}")
    assert sum(r.sessions for r in p.replicas) == 10


async def test_limiter_bounds_concurrency_and_queue():
    lim = Limiter(2, 1)
    running, peak = 0, 0
    release = asyncio.Event()

    async def job():
        nonlocal running, peak
        async with lim.slot():
            running += 1
            peak = max(peak, running)
            await release.wait()
            running -= 1

    tasks = [asyncio.create_task(job()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert lim.running == 2 and lim.waiting == 1
    with pytest.raises(OverloadedError) as info:
        async with lim.slot():
            pass
    assert info.value.status_code == 429 and info.value.retry_after > 0 and "max_queue=1" in info.value.message
    release.set()
    await asyncio.gather(*tasks)
    assert peak == 2 and lim.running == 0


def test_backoff_grows_caps_and_honours_retry_after():
    assert 0.375 <= backoff_delay(0, 0.5) <= 0.5
    assert 1.5 <= backoff_delay(2, 0.5) <= 2.0
    assert backoff_delay(10, 0.5) <= 8.0
    assert backoff_delay(0, 0.5, retry_after=3.0) == 3.0
