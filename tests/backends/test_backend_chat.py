"""The chat backend against fake OpenAI-compatible chat servers: replicas, affinity, health,
retries, limits, token IDs, reasoning fields, client-side parsing and streaming."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gymserve.backends import RequestContext, build_backend
from gymserve.backends.chat import ChatBackend
from gymserve.config import ConfigError, validate_config
from gymserve.errors import OverloadedError, UpstreamConnectionError, UpstreamError
from helpers.fakes import ChatScript, FakeServer, chat_chunks, completion, sse, vllm_error

KEY = "sk-chat-SECRET-abcdef0123"
MSG = [{"role": "user", "content": "hi"}]


def make(urls, max_queue=1024, **options) -> ChatBackend:
    cfg = validate_config(
        {
            "server": {"max_queue": max_queue},
            "backend": {
                "type": "chat",
                "base_urls": urls,
                "model": "policy",
                "api_key": KEY,
                "retry_backoff": 0.01,
                **options,
            },
        }
    )
    return build_backend(cfg)


@pytest.fixture
def servers():
    started = []

    def start(script=None, port=None):
        s = FakeServer(script or ChatScript(name=f"r{len(started)}"), port=port).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


async def test_chat_passes_body_model_key_and_options(servers):
    s = servers()
    b = make(
        [s.url + "/v1/"],
        chat_template_kwargs={"enable_thinking": False},
        extra_body={"top_k": 20},
        default_headers={"X-Team": "rl"},
        served_model_name="public",
    )
    out = await b.chat({"model": "whatever", "messages": MSG, "max_tokens": 4, "top_k": 5}, RequestContext())
    rec = s.requests[-1]
    assert rec.path == "/v1/chat/completions" and rec.headers["authorization"] == f"Bearer {KEY}"
    assert rec.headers["x-team"] == "rl"
    assert rec.body == {
        "model": "policy",
        "messages": MSG,
        "max_tokens": 4,
        "top_k": 5,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert out["choices"][0]["message"]["content"] == "from r0" and out["model"] == "public"
    assert await b.models() == ["public"]
    await b.close()


async def test_no_key_sends_placeholder_not_the_environment(servers, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env-should-not-leak")
    s = servers()
    b = build_backend(validate_config({"backend": {"type": "chat", "base_url": s.url + "/v1"}}))
    await b.chat({"model": "m", "messages": MSG}, RequestContext())
    assert s.requests[-1].headers["authorization"] == "Bearer EMPTY"
    assert await b.models() == ["policy"]  # asked upstream: no model configured
    await b.close()


async def test_responses_go_through_the_converter(servers):
    s = servers(ChatScript(default=lambda r: (200, completion("4", reasoning="2+2=4", model="policy"))))
    b = make([s.url + "/v1"])
    resp = await b.responses({"model": "policy", "input": "2+2?", "max_output_tokens": 16}, RequestContext())
    assert s.requests[-1].body["messages"][-1] == {"role": "user", "content": "2+2?"}
    assert [i["type"] for i in resp["output"]] == ["reasoning", "message"] and resp["status"] == "completed"
    await b.close()


@pytest.mark.parametrize(
    "fields", [{"reasoning": "r"}, {"reasoning_content": "r"}, {"reasoning": "r", "reasoning_content": "r"}]
)
async def test_reasoning_comes_back_under_both_names(servers, fields):
    s = servers(ChatScript(default=lambda r: (200, completion("4", **fields))))
    b = make([s.url + "/v1"])
    msg = (await b.chat({"messages": MSG}, RequestContext()))["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "r"
    await b.close()


async def test_sessions_stick_to_a_replica_and_new_ones_round_robin(servers):
    a, c = servers(), servers()
    b = make([a.url + "/v1", c.url + "/v1"])
    seen = {}
    for _turn in range(3):
        for sid in ("s1", "s2", "s3", "s4"):
            out = await b.chat({"messages": MSG}, RequestContext(session_id=sid))
            seen.setdefault(sid, set()).add(out["choices"][0]["message"]["content"])
    assert all(len(v) == 1 for v in seen.values())
    assert {next(iter(v)) for v in seen.values()} == {"from r0", "from r1"}
    await b.close()


async def test_dead_replica_is_skipped_and_comes_back(servers):
    a, c = servers(), servers()
    b = make([a.url + "/v1", c.url + "/v1"], health_check_interval=0.05)
    first = (await b.chat({"messages": MSG}, RequestContext(session_id="s")))["choices"][0]["message"]["content"]
    dead = a if first == "from r0" else c
    dead.stop()
    # The session's replica is gone: the call fails over (connection errors are retried).
    out = await b.chat({"messages": MSG}, RequestContext(session_id="s"))
    assert out["choices"][0]["message"]["content"] != first
    assert (await b.health())["status"] == "degraded"
    servers(ChatScript(name="back"), port=dead.port)
    for _ in range(100):
        if (await b.health())["status"] == "ok":
            break
        await asyncio.sleep(0.02)
    assert (await b.health())["status"] == "ok"
    await b.close()


def test_health_is_true_from_start_up_and_follows_the_replica_within_one_interval(servers):
    """Nothing listens at the replica's port: /health says down (503) right after start-up, with
    the URL, the last probe time and why; once a server listens there, ok within one interval."""
    import time

    import httpx

    from gymserve.server.run import start_background_server
    from helpers.fakes import free_port

    interval = 0.5
    port = free_port()
    cfg = validate_config(
        {
            "server": {"port": 0},
            "backend": {
                "type": "chat",
                "base_urls": [f"http://127.0.0.1:{port}/v1"],
                "model": "policy",
                "api_key": KEY,
                "health_check_interval": interval,
            },
        }
    )
    with start_background_server(cfg) as srv:
        root = srv.base_url.removesuffix("/v1")
        t_start = time.time()
        r = httpx.get(root + "/health", timeout=10)
        assert r.status_code == 503, r.text
        health = r.json()
        assert health["status"] == "down" and health["backend"] == "chat" and health["probe_interval_s"] == interval
        assert health["probe"] == "GET {base_url}/models"
        [replica] = health["replicas"]
        assert replica["base_url"] == f"http://127.0.0.1:{port}/v1" and replica["healthy"] is False
        assert t_start - 5 < replica["last_probe_at"] <= time.time()
        assert f"http://127.0.0.1:{port}/v1/models" in replica["last_error"]
        assert f"nothing is listening on 127.0.0.1:{port}" in replica["last_error"] and KEY not in r.text
        servers(ChatScript(name="late"), port=port)
        t_up = time.monotonic()
        while (r := httpx.get(root + "/health", timeout=10)).json()["status"] != "ok":
            assert time.monotonic() - t_up < interval + 2.0, r.text  # one interval (+ a probe and slack on 2 cores)
            time.sleep(0.05)
        assert r.status_code == 200 and r.json()["replicas"][0]["last_error"] is None
        assert r.json()["replicas"][0]["healthy"] is True
        out = httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG}, timeout=10)
        assert out.json()["choices"][0]["message"]["content"] == "from late"


async def test_one_replica_is_probed_too(servers):
    """A single replica used to be probed never, so /health trusted it until a request failed."""
    s = servers()
    b = make([s.url + "/v1"], health_check_interval=0.05)
    assert (await b.health())["status"] == "ok"
    assert [r.path for r in s.requests] == ["/v1/models"]  # the first probe, at start-up
    s.stop()
    for _ in range(100):
        if (await b.health())["status"] == "down":
            break
        await asyncio.sleep(0.02)
    assert (await b.health())["status"] == "down"
    await b.close()


async def test_retries_5xx_and_429_then_succeeds(servers):
    s = servers(ChatScript(plan=[vllm_error("busy", 503), (429, {"error": {"message": "slow"}}, {"retry-after": "0"})]))
    b = make([s.url + "/v1"])
    out = await b.chat({"messages": MSG}, RequestContext())
    assert out["choices"][0]["message"]["content"] == "from replica" and len(s.chat_requests()) == 3
    await b.close()


async def test_retries_are_bounded(servers):
    s = servers(ChatScript(plan=[vllm_error("boom", 500)] * 5))
    b = make([s.url + "/v1"], max_retries=2)
    with pytest.raises(UpstreamError) as info:
        await b.chat({"messages": MSG}, RequestContext())
    assert info.value.status_code == 502 and "500" in info.value.message and len(s.chat_requests()) == 3
    await b.close()


async def test_context_overflow_is_an_empty_length_reply_without_retry(servers):
    overflow = vllm_error("This model's maximum context length is 32768 tokens. However, you requested 32818 tokens.")
    s = servers(ChatScript(plan=[overflow, overflow, overflow]))
    b = make([s.url + "/v1"])
    out = await b.chat({"model": "policy", "messages": MSG}, RequestContext())
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["message"]["content"] is None
    resp = await b.responses({"model": "policy", "input": "hi"}, RequestContext())
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"] == [] and len(s.chat_requests()) == 2
    chunks = [c async for c in b.chat_stream({"model": "policy", "messages": MSG}, RequestContext())]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    await b.close()


async def test_other_400_passes_through(servers):
    s = servers(ChatScript(plan=[vllm_error("Invalid tool schema")]))
    b = make([s.url + "/v1"])
    with pytest.raises(UpstreamError) as info:
        await b.chat({"messages": MSG}, RequestContext())
    assert info.value.status_code == 400 and info.value.message == "Invalid tool schema" and len(s.chat_requests()) == 1
    await b.close()


async def test_overload_beyond_the_queue(servers):
    gate = asyncio.Event()

    async def slow(r):
        await gate.wait()
        return 200, completion("slow")

    s = servers(ChatScript(default=slow))
    b = make([s.url + "/v1"], max_queue=1, num_concurrent_requests=1)
    first = asyncio.create_task(b.chat({"messages": MSG}, RequestContext()))
    second = asyncio.create_task(b.chat({"messages": MSG}, RequestContext()))
    await asyncio.sleep(0.2)
    with pytest.raises(OverloadedError) as info:
        await b.chat({"messages": MSG}, RequestContext())
    assert info.value.status_code == 429
    gate.set()
    await asyncio.gather(first, second)
    await b.close()


async def test_unreachable_error_names_url_and_never_the_key(servers, caplog):
    s = servers()
    port = s.port
    s.stop()
    b = make([f"http://127.0.0.1:{port}/v1"], max_retries=1)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(UpstreamConnectionError) as info:
        await b.chat({"messages": MSG}, RequestContext())
    assert (
        f"http://127.0.0.1:{port}/v1/chat/completions" in info.value.message
        and "ConnectionRefusedError" in info.value.message
    )
    assert KEY not in info.value.message and KEY not in caplog.text and "retry 1/1" in caplog.text
    await b.close()


# ------------------------------------------------------------------------------ token IDs
def vllm_answer(r):
    lp = {"content": [{"token": "token_id:11", "logprob": -0.5}, {"token": "token_id:12", "logprob": -0.25}]}
    c = completion("ab", extra={"prompt_token_ids": [1, 2, 3]})
    c["choices"][0].update(token_ids=[11, 12], logprobs=lp)
    return 200, c


async def test_token_ids_requested_in_vllm_forms_and_moved_to_the_message(servers):
    s = servers(ChatScript(default=vllm_answer))
    b = make([s.url + "/v1"], return_token_id_information=True)
    out = await b.chat({"messages": MSG}, RequestContext())
    body = s.requests[-1].body
    assert (
        body["return_token_ids"]
        and body["logprobs"]
        and body["return_tokens_as_token_ids"]
        and body["top_logprobs"] == 0
    )
    msg = out["choices"][0]["message"]
    assert (msg["prompt_token_ids"], msg["generation_token_ids"], msg["generation_log_probs"]) == (
        [1, 2, 3],
        [11, 12],
        [-0.5, -0.25],
    )
    assert out["choices"][0]["logprobs"] is None  # the client did not ask for them
    resp = await b.responses({"input": "x"}, RequestContext())
    assert resp["output"][-1]["generation_token_ids"] == [11, 12]
    await b.close()


def vllm_stream(pieces, *, prompt=(1, 2, 3), finish="stop"):
    """vLLM's streamed answer with return_token_ids + logprobs/return_tokens_as_token_ids:
    prompt_token_ids on the first chunk, token_ids and logprobs on each piece's chunk."""
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "policy"}
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
    if prompt is not None:
        first["prompt_token_ids"] = list(prompt)
    chunks = [first]
    for text, tid, lp in pieces:
        chunks.append(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": text},
                        "token_ids": [tid],
                        "logprobs": {"content": [{"token": f"token_id:{tid}", "logprob": lp}]},
                    }
                ],
            }
        )
    if finish:
        chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish, "token_ids": []}]})
    return chunks


PIECES = [("Hel", 11, -0.5), ("lo", 12, -0.25), ("!", 13, -0.125)]


def streaming_vllm(r):
    if r.body.get("stream"):
        return sse(vllm_stream(PIECES))
    c = completion("Hello!", extra={"prompt_token_ids": [1, 2, 3]})
    c["choices"][0].update(
        token_ids=[11, 12, 13], logprobs={"content": [{"token": f"token_id:{t}", "logprob": lp} for _, t, lp in PIECES]}
    )
    return 200, c


async def test_token_ids_streamed_by_vllm_ride_on_the_finish_chunk(servers):
    s = servers(ChatScript(default=streaming_vllm))
    b = make([s.url + "/v1"], return_token_id_information=True)
    whole = (await b.chat({"messages": MSG}, RequestContext()))["choices"][0]["message"]
    chunks = [c async for c in b.chat_stream({"messages": MSG, "stream": True}, RequestContext())]
    assert s.requests[-1].body["stream"] is True and s.requests[-1].body["return_token_ids"] is True
    # Streamed as it came (one chunk per piece), not fetched whole.
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] == ["Hel", "lo", "!"]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop"
    fields = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    assert (
        [last["delta"][f] for f in fields]
        == [whole[f] for f in fields]
        == [[1, 2, 3], [11, 12, 13], [-0.5, -0.25, -0.125]]
    )
    # vLLM's own fields are not forwarded, nor the log-probs the client did not ask for.
    assert not any("token_ids" in ch or ch.get("logprobs") for c in chunks for ch in c["choices"])
    assert not any("prompt_token_ids" in c for c in chunks)
    kept = [c async for c in b.chat_stream({"messages": MSG, "stream": True, "logprobs": True}, RequestContext())]
    assert [
        e["logprob"] for c in kept for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content", [])
    ] == [-0.5, -0.25, -0.125]
    # The Responses stream over it carries the same fields on its last item.
    events = [e async for e in b.responses_stream({"model": "policy", "input": "x", "stream": True}, RequestContext())]
    item = events[-1]["response"]["output"][-1]
    assert [item[f] for f in fields] == [whole[f] for f in fields]
    await b.close()


async def test_streamed_token_ids_use_tokenize_for_a_missing_prompt_and_fail_on_a_cut_stream(servers):
    s = servers(
        ChatScript(
            default=lambda r: sse(vllm_stream(PIECES, prompt=None)),
            tokenize=lambda r: (200, {"count": 2, "tokens": [5, 6]}),
        )
    )
    b = make([s.url + "/v1"], return_token_id_information=True)
    chunks = [c async for c in b.chat_stream({"messages": MSG, "stream": True}, RequestContext())]
    assert chunks[-1]["choices"][0]["delta"]["prompt_token_ids"] == [5, 6]
    s.handler.default = lambda r: sse(vllm_stream(PIECES, finish=None))
    with pytest.raises(UpstreamError, match="without a finish_reason") as info:
        [c async for c in b.chat_stream({"messages": MSG, "stream": True}, RequestContext())]
    assert info.value.code == "stream_incomplete"  # the caller's stream check (stream_end), for every stream
    s.handler.default = lambda r: sse(
        [
            {k: v for k, v in c.items() if k != "prompt_token_ids"}
            | {"choices": [{**ch, "logprobs": None} for ch in c["choices"]]}
            for c in vllm_stream(PIECES)
        ]
    )
    s.handler.tokenize = lambda r: (200, {"tokens": [5]})
    with pytest.raises(UpstreamError, match="no log-probs in the answer"):
        [c async for c in b.chat_stream({"messages": MSG, "stream": True}, RequestContext())]
    await b.close()


async def test_prompt_ids_from_tokenize_fallback_and_message_level_fields(servers):
    def logprobs_only(r):
        c = completion("a")
        c["choices"][0]["logprobs"] = {"content": [{"token": "token_id:7", "logprob": -1.0}]}
        return 200, c

    s = servers(ChatScript(default=logprobs_only, tokenize=lambda r: (200, {"count": 2, "tokens": [5, 6]})))
    b = make([s.url + "/v1"], return_token_id_information=True)
    msg = (await b.chat({"messages": MSG}, RequestContext()))["choices"][0]["message"]
    assert msg["prompt_token_ids"] == [5, 6] and msg["generation_token_ids"] == [7]
    tok = [r for r in s.requests if r.path == "/tokenize"][0]
    assert tok.body["messages"] == MSG and tok.body["add_generation_prompt"] is True
    s.handler.default = lambda r: (
        200,
        completion("a", prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[-0.1]),
    )
    msg = (await b.chat({"messages": MSG}, RequestContext()))["choices"][0]["message"]
    assert msg["generation_log_probs"] == [-0.1]
    await b.close()


@pytest.mark.parametrize(
    "answer, words",
    [
        (completion("a"), "no generation token IDs"),
        (completion("a", prompt_token_ids=[1], generation_token_ids=[2]), "must come together"),
        (
            completion("a", prompt_token_ids=[1], generation_token_ids=[2, 3], generation_log_probs=[-1.0]),
            "one log-prob per",
        ),
    ],
)
async def test_partial_token_metadata_is_an_error(servers, answer, words):
    s = servers(ChatScript(default=lambda r: (200, answer), tokenize=lambda r: (200, {"tokens": [1]})))
    b = make([s.url + "/v1"], return_token_id_information=True)
    with pytest.raises(UpstreamError, match=words) as info:
        await b.chat({"messages": MSG}, RequestContext())
    assert info.value.status_code == 502 and info.value.code == "upstream_token_ids"
    await b.close()


# ------------------------------------------------------------------------------ parsing, streaming
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


async def test_client_side_parsers_for_raw_text_servers(servers):
    raw = '<think>user wants weather</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    s = servers(ChatScript(default=lambda r: (200, completion(raw))))
    b = make([s.url + "/v1"], tool_parser="hermes", reasoning_parser="qwen3")
    out = await b.chat({"messages": MSG, "tools": TOOLS}, RequestContext())
    msg, choice = out["choices"][0]["message"], out["choices"][0]
    assert msg["reasoning_content"] == "user wants weather" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"
    with pytest.raises(ConfigError, match="tool_parser|tool-call parser"):
        make([s.url + "/v1"], tool_parser="no-such-parser")
    await b.close()


def _fine_chunks(comp, size=3):
    """``comp`` streamed in ``size``-character content pieces (finer than fakes.chat_chunks)."""
    text = comp["choices"][0]["message"]["content"]
    chunks = chat_chunks(comp)
    head, tail = chunks[0], chunks[-1]
    body = [
        {**head, "choices": [{"index": 0, "delta": {"content": text[i : i + size]}, "finish_reason": None}]}
        for i in range(0, len(text), size)
    ]
    return [head, *body, tail]


def _fold(chunks):
    """Content, reasoning, calls [(name, arguments, number of argument pieces)] and finish reason."""
    content = reasoning = ""
    calls: dict[int, list] = {}
    finish = None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], [tc.get("function", {}).get("name"), "", 0])
                piece = tc.get("function", {}).get("arguments")
                if piece:
                    entry[1] += piece
                    entry[2] += 1
            finish = ch.get("finish_reason") or finish
    return content or None, reasoning or None, [tuple(calls[i]) for i in sorted(calls)], finish


async def test_client_side_parsers_parse_a_stream_as_it_arrives(servers):
    raw = (
        "<think>user wants weather</think>\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    )
    comp = completion(raw)
    s = servers(ChatScript(default=lambda r: sse(_fine_chunks(comp)) if r.body.get("stream") else (200, comp)))
    b = make([s.url + "/v1"], tool_parser="hermes", reasoning_parser="qwen3")
    whole = (await b.chat({"messages": MSG, "tools": TOOLS}, RequestContext()))["choices"][0]
    chunks = [c async for c in b.chat_stream({"messages": MSG, "tools": TOOLS, "stream": True}, RequestContext())]
    content, reasoning, calls, finish = _fold(chunks)
    args = '{"city": "Paris", "unit": "celsius"}'
    assert (content, reasoning, finish) == ("Checking.", "user wants weather", "tool_calls")
    assert calls[0][:2] == ("get_weather", args) and calls[0][2] > 5  # arguments streamed piece by piece
    assert (whole["message"]["content"], whole["message"]["reasoning_content"], whole["finish_reason"]) == (
        content,
        reasoning,
        finish,
    )
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]] == [
        c[:2] for c in calls
    ]
    assert not any("<tool_call>" in (ch["delta"].get("content") or "") for c in chunks for ch in c["choices"])
    # The Responses stream over it: same final response as the non-streamed call.
    body = {
        "model": "policy",
        "input": "x",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    }
    events = [e async for e in b.responses_stream({**body, "stream": True}, RequestContext())]
    full = await b.responses(body, RequestContext())
    final = events[-1]["response"]
    assert [e["type"] for e in events].count("response.function_call_arguments.delta") > 5
    assert (
        [(i["type"], i.get("arguments")) for i in final["output"]]
        == [(i["type"], i.get("arguments")) for i in full["output"]]
        == [("reasoning", None), ("message", None), ("function_call", args)]
    )
    await b.close()


async def test_streaming_passthrough(servers):
    chunks = [
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "policy",
            "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning": "hm"}, "finish_reason": None}],
        },
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "policy",
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
        },
    ]
    s = servers(ChatScript(default=lambda r: sse(chunks)))
    b = make([s.url + "/v1"])
    got = [c async for c in b.chat_stream({"messages": MSG, "stream": True}, RequestContext())]
    assert s.requests[-1].body["stream"] is True
    assert (
        got[0]["choices"][0]["delta"]["reasoning_content"] == "hm" and got[1]["choices"][0]["delta"]["content"] == "hi"
    )
    await b.close()


async def test_responses_stream_over_the_chat_stream(servers):
    chunks = [
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "policy",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}],
        },
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "policy",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        },
    ]
    s = servers(ChatScript(default=lambda r: sse(chunks)))
    b = make([s.url + "/v1"])
    events = [e async for e in b.responses_stream({"model": "policy", "input": "x", "stream": True}, RequestContext())]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "hi"
    await b.close()
