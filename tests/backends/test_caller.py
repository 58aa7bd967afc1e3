"""Routing through the chat backend's caller against real OpenAI-compatible servers on 127.0.0.1:
stickiness and ``X-Session-ID`` upstream, least-loaded placement, a replica's circuit breaker going
open → half-open → closed, the retry budget, an upstream 429 with ``Retry-After``, and streams
counted as load until they end. Each server records every request it gets (``helpers.fakes``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.backends.chat import ChatBackend
from gymserve.config import validate_config
from gymserve.errors import UpstreamServerError
from helpers.fakes import ChatScript, FakeServer, chat_answer, completion

MSG = [{"role": "user", "content": "hi"}]


def make(urls, **options) -> ChatBackend:
    routing = options.pop("routing", {})
    return build_backend(
        validate_config(
            {
                "backend": {
                    "type": "chat",
                    "base_urls": urls,
                    "model": "policy",
                    "retry_backoff": 0.01,
                    "health_check_interval": 0,
                    "routing": routing,
                    **options,
                }
            }
        )
    )


@pytest.fixture
def servers():
    started = []

    def start(script=None):
        s = FakeServer(script or ChatScript(name=f"r{len(started)}")).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def sessions_seen(server) -> list[str | None]:
    return [r.headers.get("x-session-id") for r in server.chat_requests()]


async def turn(backend, session, content="hi") -> str:
    out = await backend.chat({"messages": [{"role": "user", "content": content}]}, RequestContext(session_id=session))
    return out["choices"][0]["message"]["content"]


async def wait_for(predicate, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def gated(name: str, gate: threading.Event):
    """A replica that holds every call whose last message says "hold" until ``gate`` is set."""

    async def answer(r):
        if r.body["messages"][-1]["content"] == "hold":
            await asyncio.to_thread(gate.wait, 10)
        return chat_answer(r, completion(f"from {name}", model="policy"))

    return ChatScript(name=name, default=answer)


# ------------------------------------------------------------------------------ stickiness
async def test_sessions_spread_stick_and_carry_their_id_upstream(servers):
    reps = [servers() for _ in range(3)]
    b = make([s.url + "/v1" for s in reps])
    for _ in range(3):
        for sid in ("s1", "s2", "s3", "s4", "s5", "s6"):
            await turn(b, sid)
    per_server = [sessions_seen(s) for s in reps]
    # Every turn of a session on one replica, two sessions per replica, the ID in X-Session-ID.
    assert [len(set(seen)) for seen in per_server] == [2, 2, 2]
    assert sorted(sid for seen in per_server for sid in set(seen)) == ["s1", "s2", "s3", "s4", "s5", "s6"]
    assert all(len(seen) == 6 for seen in per_server)
    rows = (await b.health())["replicas"]
    assert [(r["sessions"], r["in_flight"], r["later_turns"], r["affinity_hits"]) for r in rows] == [(2, 0, 4, 4)] * 3
    await b.close()


async def test_session_id_is_not_sent_when_forwarding_is_off(servers):
    s = servers()
    b = make([s.url + "/v1"], forward_session_id=False)
    await turn(b, "secret-rollout")
    assert sessions_seen(s) == [None]
    await b.close()


async def test_a_new_session_goes_to_the_replica_with_fewest_calls_in_flight(servers):
    gate = threading.Event()
    reps = [servers(gated(f"r{i}", gate)) for i in range(3)]
    b = make([s.url + "/v1" for s in reps])
    assert [await turn(b, sid) for sid in ("a", "b", "c")] == ["from r0", "from r1", "from r2"]
    held = [asyncio.create_task(turn(b, sid, "hold")) for sid in ("a", "b")]  # r0 and r1 busy
    await wait_for(lambda: len(reps[0].chat_requests()) == 2 and len(reps[1].chat_requests()) == 2)
    assert await turn(b, "d") == "from r2"  # the idle one, though it already has a session
    assert [r.in_flight for r in b.pool.replicas] == [1, 1, 0]
    gate.set()
    assert await asyncio.gather(*held) == ["from r0", "from r1"]  # the held turns stayed home
    assert [r.in_flight for r in b.pool.replicas] == [0, 0, 0]
    await b.close()


async def test_a_stream_counts_as_load_until_it_ends(servers):
    gate = threading.Event()

    def slow_stream(r):
        from starlette.responses import StreamingResponse

        from helpers.fakes import chat_chunks

        chunks = chat_chunks(completion("streamed answer", model="policy"), include_usage=True)

        def gen():
            import json

            for i, c in enumerate(chunks):
                if i == 2:
                    gate.wait(10)
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    a, c = servers(ChatScript(name="a", default=slow_stream)), servers(ChatScript(name="c"))
    b = make([a.url + "/v1", c.url + "/v1"])
    got: list[dict] = []

    async def consume():
        async for chunk in b.chat_stream({"messages": MSG, "stream": True}, RequestContext(session_id="streamer")):
            got.append(chunk)

    task = asyncio.create_task(consume())
    await wait_for(lambda: len(got) >= 2)
    assert [r.in_flight for r in b.pool.replicas] == [1, 0]  # headers long arrived; still in flight
    assert await turn(b, "other") == "from c"
    gate.set()
    await task
    assert [r.in_flight for r in b.pool.replicas] == [0, 0]
    assert b.pool.replicas[0].stats.prompt_tokens == 5  # the stream's usage chunk was counted
    await b.close()


# ------------------------------------------------------------------------------ circuit breaker
async def test_breaker_opens_after_failures_lets_one_trial_through_and_closes(servers):
    broken = {"on": True}

    def flaky(r):
        if broken["on"]:
            return 500, {"error": {"message": "CUDA error: an illegal memory access", "type": "InternalServerError"}}
        return 200, completion("from r0", model="policy")

    r0, r1 = servers(ChatScript(name="r0", default=flaky)), servers(ChatScript(name="r1"))
    b = make(
        [r0.url + "/v1", r1.url + "/v1"],
        max_retries=2,
        routing={"breaker_failures": 2, "breaker_cooldown": 0.4},
    )
    t0 = time.monotonic()
    # A new session lands on r0 (idle), fails there and is answered by r1 at once. One failure does
    # not move it (r0's breaker is closed), so its next turn tries r0 again: the second failure opens it.
    assert [await turn(b, "a"), await turn(b, "a")] == ["from r1", "from r1"]
    assert time.monotonic() - t0 < 1.0  # failover without backoff
    health = await b.health()
    row0 = health["replicas"][0]
    assert health["status"] == "degraded" and row0["breaker"] == "open" and row0["healthy"] is False
    assert "CUDA error" in row0["last_error"] and row0["failures"] == 2 and row0["breaker_opens"] == 1
    # Open: no calls reach r0, even for new sessions that would otherwise go there.
    assert [await turn(b, sid) for sid in ("c", "d", "e")] == ["from r1"] * 3
    assert len(r0.chat_requests()) == 2
    # Half-open after the cool-down: one trial; it fails, so the breaker re-opens for twice as long.
    await asyncio.sleep(0.45)
    assert (await b.health())["replicas"][0]["breaker"] == "half_open"
    assert await turn(b, "f") == "from r1"
    assert len(r0.chat_requests()) == 3 and b.pool.replicas[0].breaker.state == "open"
    assert b.pool.replicas[0].breaker.current_cooldown == pytest.approx(0.8)
    # Fixed: the next trial succeeds and closes the breaker; r0 takes new sessions again.
    broken["on"] = False
    await asyncio.sleep(0.85)
    assert await turn(b, "g") == "from r0"
    health = await b.health()
    assert health["status"] == "ok" and health["replicas"][0]["breaker"] == "closed"
    assert health["replicas"][0]["last_error"] is None
    assert await turn(b, "h") == "from r0"  # least loaded again: it has the fewest sessions
    await b.close()


async def test_refused_connection_opens_the_breaker_at_once(servers):
    r0, r1 = servers(ChatScript(name="r0")), servers(ChatScript(name="r1"))
    b = make([r0.url + "/v1", r1.url + "/v1"], routing={"breaker_failures": 5})
    assert await turn(b, "s") == "from r0"
    r0.stop()
    assert await turn(b, "s") == "from r1"  # moved, one failed attempt
    row0 = (await b.health())["replicas"][0]
    assert row0["breaker"] == "open" and row0["failures"] == 1 and "cannot reach upstream host" in row0["last_error"]
    assert b.pool.sessions.home("s") is b.pool.replicas[1]
    await b.close()


# ------------------------------------------------------------------------------ retry budget
async def test_retry_budget_caps_retries_across_calls_and_refills_with_successes(servers):
    failing = {"on": True}

    def answer(r):
        if failing["on"]:
            return 503, {"error": {"message": "overloaded", "type": "ServiceUnavailable"}}
        return 200, completion("ok", model="policy")

    reps = [servers(ChatScript(name=f"r{i}", default=answer)) for i in range(2)]
    b = make(
        [s.url + "/v1" for s in reps],
        max_retries=5,
        # floor: 0.1/s x 10 s = 1 retry per window; each success adds 0.5; breakers out of the way.
        routing={"retry_budget_min_per_s": 0.1, "retry_budget_ratio": 0.5, "breaker_failures": 100},
    )

    def sent() -> int:
        return sum(len(s.chat_requests()) for s in reps)

    with pytest.raises(UpstreamServerError, match="overloaded"):
        await turn(b, "a")
    assert sent() == 2  # the first try and the one retry the floor allows, not 1 + max_retries
    with pytest.raises(UpstreamServerError):
        await turn(b, "b")
    assert sent() == 3  # no retry left
    failing["on"] = False
    for i in range(4):
        await turn(b, f"ok{i}")  # 4 successes: 2 more retries
    assert sent() == 7
    failing["on"] = True
    with pytest.raises(UpstreamServerError):
        await turn(b, "c")
    assert sent() == 10  # the try and 2 retries
    budget = (await b.health())["retry_budget"]
    assert budget["retries"] == 3 and budget["denied"] == 3 and budget["balance"] < 1
    await b.close()


# ------------------------------------------------------------------------------ 429 / Retry-After
async def test_429_retries_elsewhere_now_and_keeps_calls_away_until_retry_after(servers):
    r0 = servers(ChatScript(name="r0", plan=[(429, {"error": {"message": "slow down"}}, {"Retry-After": "1"})]))
    r1 = servers(ChatScript(name="r1"))
    b = make([r0.url + "/v1", r1.url + "/v1"], routing={"breaker_failures": 1})
    t0 = time.monotonic()
    assert await turn(b, "a") == "from r1"
    assert time.monotonic() - t0 < 0.5  # not the 1 s Retry-After: another replica was free
    # Inside the Retry-After, new sessions go to r1 though r0 has fewer sessions; its breaker is untouched.
    assert [await turn(b, sid) for sid in ("b", "c")] == ["from r1", "from r1"]
    assert len(r0.chat_requests()) == 1 and b.pool.replicas[0].breaker.state == "closed"
    await asyncio.sleep(max(0.0, 1.05 - (time.monotonic() - t0)))
    assert await turn(b, "d") == "from r0"
    await b.close()
