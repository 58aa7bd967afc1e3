"""The replica pool (placement, stickiness, health, breakers, throttling, the filter hook), the
concurrency limiter and retry delays, with a hand-set clock where time matters."""

from __future__ import annotations

import asyncio

import pytest

from gymserve.backends.pool import Limiter, Outcome, Replica, ReplicaPool, backoff_delay, usage_of
from gymserve.config import RoutingConfig
from gymserve.errors import OverloadedError, UpstreamConnectionError
from helpers.clock import ManualClock


def pool(n=3, *, clock=None, **routing) -> ReplicaPool:
    kw = {"clock": clock} if clock is not None else {}
    probe = routing.pop("probe", None)
    interval = routing.pop("interval", 10.0)
    return ReplicaPool(
        [Replica(f"http://r{i}/v1") for i in range(n)],
        probe=probe,
        interval=interval,
        routing=RoutingConfig(**routing),
        **kw,
    )


def names(replicas) -> list[str]:
    return [r.base_url.split("//")[1].split("/")[0] for r in replicas]


def test_new_sessions_spread_then_stick():
    p = pool()
    first = [p.pick(f"s{i}") for i in range(3)]
    for r in first:
        p.release(r, Outcome.OK)
    assert names(first) == ["r0", "r1", "r2"]  # equal load: fewest sessions, then rotation
    for _ in range(3):
        turn = [p.pick(f"s{i}") for i in range(3)]
        assert turn == first
        for r in turn:
            p.release(r, Outcome.OK)
    assert [(r.sessions, r.active_sessions, r.in_flight) for r in p.replicas] == [(1, 1, 0)] * 3


def test_a_new_session_goes_to_the_replica_with_fewest_calls_in_flight():
    p = pool()
    busy = [p.pick("a"), p.pick("b"), p.pick("c"), p.pick("a")]  # r0 has 2 in flight, r1 and r2 one each
    assert names(busy) == ["r0", "r1", "r2", "r0"]
    p.release(busy[1], Outcome.OK)  # r1: 0 in flight
    assert names([p.pick("d")]) == ["r1"]
    assert names([p.pick("e")]) == ["r2"]  # r1 and r2 now 1 in flight each; r2 has fewer sessions
    assert [r.in_flight for r in p.replicas] == [2, 1, 2]


def test_a_session_moves_only_when_its_replica_is_far_more_loaded():
    p = pool(2, rebalance_ratio=2.0, rebalance_min_gap=3)
    home, other = p.replicas
    p.release(p.pick("s"), Outcome.OK)
    assert p.sessions.home("s") is home

    def load(replica, n):
        return [p.pick(f"{replica.base_url}-{i}-{n}", where=lambda r: r is replica) for i in range(n)]

    busy = load(home, 2)  # 2 vs 0 in flight: gap 2 < 3, stays
    r = p.pick("s")
    assert r is home
    p.release(r, Outcome.OK)
    busy += load(home, 1)  # 3 vs 0: gap 3 and 3 >= 2 x 0: moves
    r = p.pick("s")
    assert r is other and p.sessions.home("s") is other and other.stats.moves_in == 1
    p.release(r, Outcome.OK)
    load(other, 4)  # other 4 vs home 3: gap 1, the session stays on its new replica
    assert p.pick("s") is other
    for c in busy:
        p.release(c, Outcome.OK)  # other 5 vs home 0: gap 5 but the ratio test also holds -> moves back
    assert p.pick("s") is home and p.sessions.moves == 2


def test_calls_without_a_session_go_to_the_least_loaded_in_rotation():
    p = pool()
    picked = [p.pick(None) for _ in range(3)]
    assert sorted(names(picked)) == ["r0", "r1", "r2"]
    for r in picked:
        p.release(r, Outcome.OK)
    again = [p.pick(None) for _ in range(6)]
    assert sorted(names(again)) == ["r0", "r0", "r1", "r1", "r2", "r2"]


def test_unhealthy_replica_is_skipped_and_comes_back():
    p = pool(2)
    a = p.pick("a")
    p.release(a, Outcome.DOWN, reason="ConnectError")
    assert a.breaker.state == "open" and not a.healthy and a.last_error == "ConnectError"
    moved = p.pick("a")
    assert moved is not a and all(p.pick(None) is moved for _ in range(4))
    assert p.status()["status"] == "degraded"
    p.mark_up(a)
    assert p.pick(None) is a  # the least loaded now
    assert p.pick("a") is moved  # the session stays where it moved
    for r in p.replicas:
        p.mark_down(r, "x")
    assert p.pick(None) in p.replicas and p.status()["status"] == "down"  # still tries when all are down
    assert p.panics == 1


def test_breaker_opens_then_lets_one_trial_through_after_the_cooldown():
    clock = ManualClock(100.0)
    p = pool(2, clock=clock, breaker_failures=2, breaker_cooldown=5.0)
    a, b = p.replicas
    for _ in range(2):
        r = p.pick(None, where=lambda r: r is a)
        p.release(r, Outcome.FAILED, reason="502 bad gateway")
    assert a.breaker.state == "open" and p.status()["replicas"][0]["breaker"] == "open"
    assert all(p.pick(f"s{i}") is b for i in range(3))
    clock.now += 5
    assert a.breaker.state == "half_open"
    trial = p.pick("new")  # a is idle and eligible for one call
    assert trial is a and p.pick("newer") is b  # no second trial while the first is out
    p.release(trial, Outcome.OK)
    assert a.breaker.state == "closed" and a.healthy


def test_a_429_keeps_calls_away_until_retry_after():
    clock = ManualClock(100.0)
    p = pool(2, clock=clock)
    a, b = p.replicas
    r = p.pick("s1")
    assert r is a
    p.release(a, Outcome.THROTTLED, retry_after=2.0)
    assert a.breaker.state == "closed" and a.healthy  # throttling says nothing about health
    assert [p.pick(f"n{i}") for i in range(3)] == [b, b, b]
    clock.now += 2.0
    assert p.pick("n9") is a


def test_filters_and_where_restrict_picks_and_are_never_relaxed():
    """The hook for other routing rules (weight versions, replicas updating weights)."""
    p = pool(3)
    r0, r1, r2 = p.replicas
    p.filters.append(lambda r: r is not r1)  # e.g. r1 is loading new weights
    assert {p.pick(f"s{i}") for i in range(6)} == {r0, r2}
    assert p.pick("v1", where=lambda r: r is r2) is r2  # e.g. the only replica on this call's version
    p.mark_down(r2, "refused")
    assert p.pick("v1", where=lambda r: r is r2) is r2  # health is relaxed (panic), the filter is not
    with pytest.raises(UpstreamConnectionError) as info:
        p.pick("v2", where=lambda r: r is r1)
    assert info.value.code == "no_replica" and "none of the 3 replicas passes the routing filters" in info.value.message


def test_exclude_prefers_replicas_this_call_has_not_tried():
    p = pool(2)
    a, b = p.replicas
    first = p.pick("s")
    p.release(first, Outcome.FAILED, reason="500")
    second = p.pick("s", exclude=[first])
    # The retry goes elsewhere, but one failure (breaker still closed) does not move the session.
    assert second is not first and p.sessions.home("s") is first
    p.release(second, Outcome.FAILED, reason="500")
    third = p.pick("s", exclude=[first, second])  # both tried: any eligible one again
    assert third in (a, b)


def test_a_session_moves_only_when_its_replica_is_unhealthy():
    p = pool(2, breaker_failures=2)
    home = p.pick("s")
    p.release(home, Outcome.FAILED, reason="503")
    retry = p.pick("s", exclude=[home])
    p.release(retry, Outcome.OK)
    assert p.sessions.home("s") is home and p.pick("s") is home  # one transient 5xx: still home
    p.release(home, Outcome.FAILED, reason="503")  # the second in a row opens its breaker
    assert home.breaker.state == "open"
    moved = p.pick("s", exclude=[home])
    assert moved is not home and p.sessions.home("s") is moved


def test_round_robin_ignores_sessions_and_consistent_hash_keeps_them():
    rr = pool(3, policy="round-robin")
    turns = []
    for _ in range(3):
        r = rr.pick("s")
        rr.release(r, Outcome.OK)
        turns.append(r)
    assert names(turns) == ["r0", "r1", "r2"] and rr.sessions.moves == 2
    ch = pool(3, policy="consistent-hash")
    homes = set()
    for _ in range(3):
        r = ch.pick("s")
        ch.release(r, Outcome.OK)
        homes.add(r)
    assert len(homes) == 1 and ch.status()["routing"] == "consistent-hash"


def test_usage_of_an_answer_feeds_the_prefix_hit_estimate():
    p = pool(2)
    r = p.pick("s")
    p.release(r, Outcome.OK, session_id="s", usage=(100, 20))
    r2 = p.pick("s")
    p.release(r2, Outcome.OK, session_id="s", usage=(150, 20))
    row = p.status()["replicas"][p.replicas.index(r)]
    assert r2 is r and row["prefix_hit_estimate"] == round(120 / 250, 4) and row["affinity_hits"] == 1


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
        p.release(p.pick(f"s{i}"), Outcome.OK)
    assert sum(r.sessions for r in p.replicas) == 10 and len(p.sessions) == 10


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


def test_usage_of_reads_chat_and_responses_usage():
    assert usage_of({"usage": {"prompt_tokens": 5, "completion_tokens": 2}}) == (5, 2)
    assert usage_of({"usage": {"input_tokens": 7, "output_tokens": 1}}) == (7, 1)
    assert usage_of({"usage": None}) is None and usage_of("text") is None


def test_on_recover_runs_when_a_replica_comes_back_and_only_then():
    """A replica back from being unhealthy (mark_up, a probe answering again, a trial call that
    closes its breaker) may have restarted: the hooks hear of it (the chat gateway re-reads its
    weight version)."""
    clock = ManualClock(100.0)
    down = {"r0"}

    async def probe(replica):
        if names([replica])[0] in down:
            raise ConnectionError("refused")

    p = pool(2, clock=clock, probe=probe, breaker_failures=1, breaker_cooldown=5.0)
    back: list[str] = []
    p.on_recover.append(lambda r: back.append(names([r])[0]))
    a, b = p.replicas
    p.mark_up(a)
    assert back == []  # healthy already: nothing came back
    p.mark_down(a, "x")
    p.mark_up(a)
    assert back == ["r0"]
    asyncio.run(p.check_all())  # r0's probe fails: down
    assert not a.healthy and back == ["r0"]
    down.clear()
    asyncio.run(p.check_all())  # it answers again
    assert a.healthy and back == ["r0", "r0"]
    r = p.pick(None, where=lambda r: r is b)
    p.release(r, Outcome.FAILED, reason="502")  # b's breaker opens
    assert not b.healthy
    clock.now += 5.0
    r = p.pick(None, where=lambda r: r is b)  # the half-open trial call
    p.release(r, Outcome.OK)
    assert b.healthy and back == ["r0", "r0", "r1"]


def test_a_forgotten_version_is_read_again_by_the_next_call():
    from gymserve.backends.chat_versions import ReplicaVersions

    reads: list[int] = []

    async def read():
        reads.append(1)
        return {"http://r0": "default"}

    async def run():
        book = ReplicaVersions(["http://r0"], read)
        await book.refresh(force=True)
        assert book.versions == {"http://r0": "default"}
        book.observe({"http://r0": "p1"})  # what the gateway last forwarded
        assert (await book.watch()).version("http://r0") == "p1" and len(reads) == 1  # known: no read
        book.forget("http://r0")  # the replica came back (a restart serves its startup weights)
        assert (await book.watch()).version("http://r0") == "default" and len(reads) == 2

    asyncio.run(run())
