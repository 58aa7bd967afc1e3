"""Broken upstreams: the chat backend against servers that time out, reset connections, answer
500/502/503/429, send malformed or truncated JSON, trickle, or stall mid-body or mid-stream.

For each: gymserve retries where it should (connection failures, 5xx, 429), fails fast with an error
that names the replica and the cause where it should (4xx, garbage, timeouts, which may still be
running upstream), never takes longer than its timeouts allow, and leaves no asyncio task or TCP
connection behind once the backend is closed. A replica that dies mid-rollout hands the session to
another replica, or fails with an error naming the replica and why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import psutil
import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.config import validate_config
from gymserve.errors import GymserveError, OverloadedError, UpstreamConnectionError, UpstreamError
from helpers.fakes import ChatScript, FakeServer, RawServer

MSG = [{"role": "user", "content": "hi"}]
TIMEOUT = 0.6  # the backend's timeout in these tests


@pytest.fixture
def raw():
    servers = []

    def start(mode):
        s = RawServer(mode)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def fake():
    servers = []

    def start(script=None, port=None):
        s = FakeServer(script or ChatScript(name=f"r{len(servers)}"), port=port).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def make(urls, **options):
    return build_backend(
        validate_config(
            {
                "backend": {
                    "type": "chat",
                    "base_urls": urls,
                    "model": "policy",
                    "timeout": TIMEOUT,
                    "max_retries": 2,
                    "retry_backoff": 0.01,
                    "health_check_interval": 0,
                    **options,
                }
            }
        )
    )


def _connections_to(port: int) -> int:
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


async def _tasks() -> int:
    await asyncio.sleep(0)
    return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])


async def _expect_failure(backend, *, stream: bool = False) -> tuple[GymserveError, float]:
    t0 = time.monotonic()
    with pytest.raises(GymserveError) as info:
        if stream:
            async for _ in backend.chat_stream({"messages": MSG}, RequestContext(session_id="s")):
                pass
        else:
            await backend.chat({"messages": MSG}, RequestContext(session_id="s"))
    return info.value, time.monotonic() - t0


# ------------------------------------------------------------------------------- HTTP statuses
@pytest.mark.parametrize("status", [500, 502, 503])
async def test_5xx_is_retried_then_reported(fake, status):
    s = fake(ChatScript(default=lambda r: (status, {"error": {"message": "engine exploded", "type": "x"}})))
    b = make([s.url + "/v1"])
    err, took = await _expect_failure(b)
    assert len(s.chat_requests()) == 3  # first try + max_retries
    assert isinstance(err, UpstreamError) and err.status_code == 502 and err.code == "upstream_server_error"
    assert f"upstream failed with {status}" in err.message and s.url in err.message and "engine exploded" in err.message
    assert took < 2
    await b.close()


async def test_transient_503_then_success(fake):
    s = fake(ChatScript(plan=[(503, {"error": {"message": "warming up"}})]))
    b = make([s.url + "/v1"])
    out = await b.chat({"messages": MSG}, RequestContext())
    assert out["choices"][0]["message"]["content"] == "from replica" and len(s.chat_requests()) == 2
    await b.close()


async def test_429_is_retried_honouring_retry_after_then_becomes_429(fake):
    s = fake(ChatScript(plan=[(429, {"error": {"message": "slow down"}}, {"Retry-After": "0.05"})]))
    b = make([s.url + "/v1"])
    await b.chat({"messages": MSG}, RequestContext())
    assert len(s.chat_requests()) == 2
    s.handler.default = lambda r: (429, {"error": {"message": "slow down"}}, {"Retry-After": "0.05"})
    err, took = await _expect_failure(b)
    assert isinstance(err, OverloadedError) and err.status_code == 429 and err.code == "upstream_rate_limited"
    assert took < 2
    await b.close()


async def test_4xx_is_not_retried(fake):
    s = fake(
        ChatScript(default=lambda r: (400, {"error": {"message": "messages[0].role is unknown", "param": "messages"}}))
    )
    b = make([s.url + "/v1"])
    err, _ = await _expect_failure(b)
    assert len(s.chat_requests()) == 1 and err.status_code == 400 and "role is unknown" in err.message
    await b.close()


# ------------------------------------------------------------------------------- transport faults
@pytest.mark.parametrize(
    "mode, retried, code, status",
    [
        ("reset", True, "upstream_unreachable", 502),
        ("close", True, "upstream_unreachable", 502),
        ("truncated", True, "upstream_unreachable", 502),
        ("malformed", False, "upstream_bad_response", 502),
        ("hang", False, "upstream_timeout", 504),
        ("stall_body", False, "upstream_timeout", 504),
        ("trickle", False, "upstream_timeout", 504),
    ],
)
async def test_transport_faults_fail_fast_and_clearly(raw, mode, retried, code, status):
    s = raw(mode)
    # Only the timeout modes need the short timeout; the others fail on their own, and a 0.6 s bound on
    # them turned a slow accept on a loaded 2-core CI machine into a timeout instead of the fault.
    timeout = TIMEOUT if code == "upstream_timeout" else 5.0
    b = make([s.url + "/v1"], timeout=timeout)
    before = await _tasks()
    err, took = await _expect_failure(b)
    assert err.code == code and err.status_code == status, err.message
    assert f"127.0.0.1:{s.port}" in err.message or "127.0.0.1" in err.message  # names the replica
    assert s.requests == (3 if retried else 1)
    # Never past its timeouts: each try is bounded by `timeout`, plus tiny backoffs.
    assert took < timeout * (3 if retried else 1) + 1.0
    if code == "upstream_timeout":
        assert f"timed out after {TIMEOUT:g} s" in err.message
    await b.close()
    assert await _tasks() <= before
    assert _connections_to(s.port) == 0


async def test_stream_that_stalls_mid_body_ends_with_an_error_in_time(raw):
    s = raw("stream_stall")
    b = make([s.url + "/v1"])
    t0 = time.monotonic()
    got = []
    with pytest.raises(UpstreamConnectionError) as info:
        async for chunk in b.chat_stream({"messages": MSG, "stream": True}, RequestContext()):
            got.append(chunk)
    assert got and got[0]["choices"][0]["delta"]["content"] == "partial"  # what came before the stall
    assert info.value.code == "upstream_timeout" and time.monotonic() - t0 < TIMEOUT + 1.0
    await b.close()
    assert _connections_to(s.port) == 0


async def test_upstream_answering_a_stream_with_plain_json_is_an_error(fake):
    s = fake()  # ChatScript answers JSON even when asked to stream
    b = make([s.url + "/v1"])
    with pytest.raises(UpstreamError) as info:
        async for _ in b.chat_stream({"messages": MSG, "stream": True}, RequestContext()):
            pass
    assert info.value.code == "upstream_bad_response" and "without any events" in info.value.message
    await b.close()


async def test_many_faults_leak_no_tasks_or_connections(raw, fake):
    """A burst of concurrent failing calls of every kind, then close: nothing left behind."""
    servers = [raw(m) for m in ("reset", "hang", "malformed", "stall_body")]
    good = fake()
    backends = [make([s.url + "/v1"], max_retries=1) for s in servers] + [make([good.url + "/v1"])]
    before = await _tasks()
    calls = [b.chat({"messages": MSG}, RequestContext()) for b in backends for _ in range(10)]
    t0 = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert time.monotonic() - t0 < 2 * TIMEOUT + 2
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 40 and all(isinstance(e, GymserveError) for e in errors)
    assert all(isinstance(r, dict) for r in results[40:])
    for b in backends:
        await b.close()
    assert await _tasks() <= before
    for s in [*servers, good]:
        assert _connections_to(s.port) == 0, s.url


# ------------------------------------------------------------------------------- replicas dying
async def test_replica_dying_mid_rollout_fails_over(fake):
    r0, r1 = fake(ChatScript(name="r0")), fake(ChatScript(name="r1"))
    b = make([r0.url + "/v1", r1.url + "/v1"])
    ctx = RequestContext(session_id="rollout-1")
    first = await b.chat({"messages": MSG}, ctx)
    owner, other = (r0, r1) if first["choices"][0]["message"]["content"] == "from r0" else (r1, r0)
    assert ctx.extra["replica"] == owner.url + "/v1"
    owner.stop()  # dies between turns
    ctx2 = RequestContext(session_id="rollout-1")
    second = await b.chat({"messages": MSG * 2}, ctx2)
    assert second["choices"][0]["message"]["content"] == f"from {other.handler.name}"
    assert ctx2.extra["replica"] == other.url + "/v1"
    health = await b.health()
    down = [r for r in health["replicas"] if not r["healthy"]]
    assert health["status"] == "degraded" and down[0]["base_url"] == owner.url + "/v1"
    assert "cannot reach upstream host" in down[0]["last_error"]
    await b.close()


async def test_replica_dying_mid_request_names_the_replica_and_why(raw):
    s = raw("reset")
    b = make([s.url + "/v1"], max_retries=0)
    err, _ = await _expect_failure(b)
    assert s.url in err.message and "cannot reach upstream host 127.0.0.1" in err.message
    assert any(w in err.message for w in ("RemoteProtocolError", "ReadError", "reset", "disconnected")), err.message
    await b.close()


async def test_every_replica_down_fails_with_each_reason(raw):
    a, c = raw("reset"), raw("close")
    b = make([a.url + "/v1", c.url + "/v1"], max_retries=3)
    err, took = await _expect_failure(b)
    assert isinstance(err, UpstreamConnectionError) and took < 3
    assert a.requests + c.requests == 4 and a.requests >= 1 and c.requests >= 1
    status = (await b.health())["replicas"]
    assert all(not r["healthy"] and r["last_error"] for r in status)
    await b.close()


def test_a_replica_dying_mid_rollout_keeps_the_rollout_token_contiguous(tiny_model_dir):
    """Three gymserve replicas on the tiny model behind a gymserve chat front end: the replica
    serving a rollout is killed between turns; the next turn fails over to another replica without
    an error, its prompt token IDs start with the previous turn's prompt + generation (the prefix
    splice runs on whichever replica gets the turn), and the rollout stays on its new replica."""
    import openai

    from gymserve.server.run import start_background_server

    def local():
        return validate_config(
            {
                "server": {"port": 0},
                "backend": {"type": "local", "model": str(tiny_model_dir), "num_threads": 1, "context_window": 512},
            }
        )

    # Imported here once: transformers' lazy attribute imports are not safe to race from threads.
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    with concurrent.futures.ThreadPoolExecutor(3) as pool_:
        replicas = list(pool_.map(lambda _: start_background_server(local()), range(3)))
    front_cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "chat",
                "base_urls": [r.base_url for r in replicas],
                "model": tiny_model_dir.name,
                "health_check_interval": 0,
                "timeout": 60,
            },
        }
    )
    try:
        with start_background_server(front_cfg) as front:
            client = openai.OpenAI(base_url=front.base_url, api_key="x", max_retries=0, timeout=60)
            pool = front.backend.pool
            messages: list[dict] = [{"role": "user", "content": "Count to three."}]
            turns, homes = [], []
            for t in range(3):
                out = client.chat.completions.create(
                    model=tiny_model_dir.name,
                    messages=messages,
                    max_tokens=6,
                    extra_headers={"X-Session-ID": "rollout-7"},
                )
                msg = out.choices[0].message.model_dump()
                turns.append(msg)
                homes.append(pool.sessions.home("rollout-7"))
                messages += [
                    {
                        "role": "assistant",
                        "content": msg["content"],
                        **{k: msg[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")},
                    },
                    {"role": "user", "content": f"Go on ({t + 2})."},
                ]
                if t == 0:  # the rollout's replica dies between its turns
                    dead = next(r for r in replicas if r.base_url == homes[0].base_url)
                    dead.stop(timeout=30)
            for prev, nxt in zip(turns, turns[1:]):
                prefix = prev["prompt_token_ids"] + prev["generation_token_ids"]
                assert nxt["prompt_token_ids"][: len(prefix)] == prefix
            assert homes[1] is not homes[0] and homes[2] is homes[1]
            row = pool.status()["replicas"][pool.replicas.index(homes[0])]
            assert row["breaker"] == "open" and "cannot reach upstream host" in row["last_error"]
            assert homes[1].stats.moves_in == 1 and homes[1].stats.affinity_hits == 1
    finally:
        for r in replicas:
            r.stop(timeout=30)


# ------------------------------------------------------------------------------- through the server
def test_server_turns_upstream_faults_into_openai_errors(raw):
    from gymserve.server.run import start_background_server

    s = raw("hang")
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "chat",
                "base_urls": [s.url + "/v1"],
                "model": "policy",
                "timeout": TIMEOUT,
                "max_retries": 0,
            },
        }
    )
    with start_background_server(cfg) as srv:
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG}, timeout=10)
        assert time.monotonic() - t0 < TIMEOUT + 1
        assert r.status_code == 504
        err = r.json()["error"]
        assert (
            err["code"] == "upstream_timeout" and err["type"] == "upstream_connection_error" and s.url in err["message"]
        )
        r = httpx.post(srv.base_url + "/responses", json={"input": "hi", "stream": True}, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"


def test_server_streams_an_error_event_when_upstream_stalls_mid_stream(raw):
    from gymserve.server.run import start_background_server

    s = raw("stream_stall")
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "chat",
                "base_urls": [s.url + "/v1"],
                "model": "policy",
                "timeout": TIMEOUT,
                "max_retries": 0,
            },
        }
    )
    with start_background_server(cfg) as srv:
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG, "stream": True}, timeout=10)
        assert time.monotonic() - t0 < TIMEOUT + 1
        assert r.status_code == 200 and "partial" in r.text
        assert "event: error" in r.text and "upstream_timeout" in r.text and r.text.endswith("data: [DONE]\n\n")
        r = httpx.post(srv.base_url + "/responses", json={"input": "hi", "stream": True}, timeout=10)
        assert "response.failed" in r.text or "event: error" in r.text


def _sse_lines(*events: str):
    """A chat stream body of raw ``data:`` lines (what a broken server sends, verbatim)."""
    from starlette.responses import StreamingResponse

    def gen():
        for e in events:
            yield f"data: {e}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


HEAD = '{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "policy", "choices": '
HI = HEAD + '[{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": null}]}'


@pytest.mark.parametrize(
    ("bad", "words", "code"),
    [
        (
            '{"object": "error", "message": "vllm boom", "type": "InternalServerError", "code": 500}',
            "vllm boom",
            "upstream_error",
        ),
        ("[1, 2]", "not a JSON object", "upstream_bad_response"),
    ],
)
def test_a_stream_broken_mid_way_ends_with_an_error_on_both_routes(bad, words, code, caplog):
    """An error object, or a data line that is not a chunk, after the stream began: the chat
    stream ends with an error the SDK raises, the Responses stream with response.failed — never a
    success holding the partial text, never a 500 'this is a bug'."""
    import openai

    from gymserve.server.run import start_background_server

    with FakeServer(ChatScript(default=lambda r: _sse_lines(HI, bad))) as s:
        cfg = validate_config(
            {
                "server": {"port": 0},
                "backend": {"type": "chat", "base_urls": [s.url + "/v1"], "model": "policy", "max_retries": 0},
            }
        )
        with start_background_server(cfg) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=10)
            with pytest.raises(openai.APIError, match=words):
                list(client.chat.completions.create(model="policy", messages=MSG, stream=True))
            events = list(client.responses.create(model="policy", input="hi", stream=True))
    assert events[-1].type == "response.failed" and words in events[-1].response.error.message
    assert "this is a bug" not in caplog.text and code in (events[-1].response.error.code, code)


def test_streamed_tool_calls_without_index_get_one():
    """Some servers leave ``index`` out of streamed tool calls; the OpenAI format (and the SDK's
    chat stream helper) requires it, so the chat route adds it."""
    import openai

    from gymserve.server.run import start_background_server

    call = HEAD + (
        '[{"index": 0, "delta": {"tool_calls": [{"id": "call_1", "type": "function", '
        '"function": {"name": "f", "arguments": "{\\"a\\""}}]}, "finish_reason": null}]}'
    )
    more = (
        HEAD + '[{"index": 0, "delta": {"tool_calls": [{"function": {"arguments": ": 1}"}}]}, "finish_reason": null}]}'
    )
    call2 = HEAD + (
        '[{"index": 0, "delta": {"tool_calls": [{"id": "call_2", "type": "function", '
        '"function": {"name": "g", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]}'
    )
    with FakeServer(ChatScript(default=lambda r: _sse_lines(HI, call, more, call2))) as s:
        cfg = validate_config(
            {
                "server": {"port": 0},
                "backend": {"type": "chat", "base_urls": [s.url + "/v1"], "model": "policy", "max_retries": 0},
            }
        )
        with start_background_server(cfg) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=10)
            with client.chat.completions.stream(model="policy", messages=MSG) as stream:
                final = stream.get_final_completion()
    # A new id is a new call; a piece without one continues the last call.
    assert [(t.id, t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls] == [
        ("call_1", "f", '{"a": 1}'),
        ("call_2", "g", "{}"),
    ]
