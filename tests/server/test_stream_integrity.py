"""Stream integrity (issue #26, symptom 1): an upstream stream that ends cleanly without its API's
terminal event — a chat choice without a ``finish_reason`` (and no ``[DONE]``), a Responses stream
without ``response.completed``, a Messages stream without ``message_stop`` — is a cut-off answer.

The client's stream ends with the API's error event (code ``stream_incomplete``), never with a
success terminator; a non-streamed call over a stream-based upstream is a 502; the replica's
``gymserve_replica_streams_incomplete`` counter in ``/metrics`` counts it.
"""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.responses import StreamingResponse

from helpers.fakes import (
    CLOUD_KEY,
    ChatScript,
    FakeServer,
    anthropic_events,
    anthropic_handler,
    anthropic_message,
    openai_handler,
    response_events,
    response_obj,
)
from helpers.servers import gateway

MSG = [{"role": "user", "content": "hi"}]
HEAD = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "policy"}


def _chunk(content: str, finish: str | None = None) -> dict:
    return {**HEAD, "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


def _raw_stream(payloads: list[str]) -> StreamingResponse:
    """A stream that ends cleanly (a well-formed end of the chunked body) after ``payloads``."""
    return StreamingResponse(iter(payloads), media_type="text/event-stream")


def _cut_chat(_r) -> StreamingResponse:
    """Three chunks, then the end of the body: no finish chunk, no ``data: [DONE]``."""
    return _raw_stream([f"data: {json.dumps(_chunk(p))}\n\n" for p in ("The ", "answer ", "is")])


def _events_sse(events: list[dict]) -> list[str]:
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture
def cut_chat():
    with FakeServer(ChatScript(default=_cut_chat)) as s:
        yield s


def test_a_chat_stream_cut_without_finish_ends_with_an_error_event_not_done(cut_chat):
    backend = {"type": "chat", "base_urls": [cut_chat.url + "/v1"], "model": "policy", "max_retries": 0}
    with gateway(backend) as srv:
        r = httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG, "stream": True}, timeout=10)
        assert r.status_code == 200
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(d) for d in data if d != "[DONE]"]
        # The three chunks were forwarded, then the error object the openai SDK raises as APIError.
        assert [c["choices"][0]["delta"].get("content") for c in chunks[:3]] == ["The ", "answer ", "is"]
        assert chunks[3]["error"]["code"] == "stream_incomplete"
        assert "finish_reason" in chunks[3]["error"]["message"]
        assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)
        assert "event: error" in r.text

        import openai

        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.APIError, match="ended the stream without"):
            list(client.chat.completions.create(model="policy", messages=MSG, stream=True))

        # The Responses route over the same cut stream: response.failed, never response.completed.
        r = httpx.post(srv.base_url + "/responses", json={"input": "hi", "stream": True}, timeout=10)
        assert "response.failed" in r.text and "response.completed" not in r.text
        assert "ended the stream without" in r.text

        # The Messages route over it: Anthropic's error event last, no message_stop.
        body = {"model": "policy", "max_tokens": 8, "messages": MSG, "stream": True}
        r = httpx.post(srv.base_url + "/messages", json=body, timeout=10)
        types = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert types[-1] == "error" and "message_stop" not in types and "ended the stream without" in r.text

        metrics = httpx.get(srv.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
        assert _metric(metrics, "gymserve_replica_streams_incomplete_total") == 4


def test_a_completions_stream_cut_without_finish_ends_with_an_error_event():
    def handler(r):
        if r.path.endswith("/models"):
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]}
        chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "policy"}
        parts = [{**chunk, "choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b")]
        return _raw_stream([f"data: {json.dumps(p)}\n\n" for p in parts])

    with FakeServer(handler) as s:
        backend = {"type": "chat", "base_urls": [s.url + "/v1"], "model": "policy", "max_retries": 0}
        with gateway(backend) as srv:
            r = httpx.post(srv.base_url + "/completions", json={"prompt": "hi", "stream": True}, timeout=10)
    assert r.status_code == 200 and "stream_incomplete" in r.text


def test_a_native_responses_stream_without_a_terminal_event_ends_with_an_error_event():
    handle = openai_handler(CLOUD_KEY, model="gpt-test")

    def handler(r):
        if r.path.endswith("/responses") and isinstance(r.body, dict) and r.body.get("stream"):
            events = response_events(response_obj("a cut answer", model="gpt-test"))
            return _raw_stream(_events_sse(events[:-1]))  # everything but response.completed
        return handle(r)

    with FakeServer(handler) as s:
        backend = {"type": "openai", "base_url": s.url + "/v1", "api_key": CLOUD_KEY, "model": "gpt-test"}
        with gateway(backend) as srv:
            r = httpx.post(srv.base_url + "/responses", json={"input": "hi", "stream": True}, timeout=10)
    assert r.status_code == 200
    types = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert types[-1] == "error" and "response.completed" not in types
    last = json.loads(r.text.strip().splitlines()[-1][6:])
    assert last["code"] == "stream_incomplete" and "response.completed" in last["message"]


def test_a_messages_stream_without_message_stop_ends_with_an_error_event():
    """The anthropic backend passes the upstream's events through: without ``message_stop`` the
    client gets Anthropic's ``error`` event last, never a stream that looks finished."""
    handle = anthropic_handler(CLOUD_KEY, model="claude-test")

    def handler(r):
        if r.path == "/v1/messages" and isinstance(r.body, dict) and r.body.get("stream"):
            events = anthropic_events(anthropic_message(r.body, "claude-test"))
            return _raw_stream(_events_sse(events[:-1]))  # no message_stop
        return handle(r)

    with FakeServer(handler) as s:
        backend = {"type": "anthropic", "base_url": s.url, "api_key": CLOUD_KEY, "model": "claude-test"}
        with gateway(backend) as srv:
            body = {"model": "claude-test", "max_tokens": 16, "messages": MSG, "stream": True}
            r = httpx.post(srv.base_url + "/messages", json=body, timeout=10)
            # The chat route over the same upstream converts the events: an error, not a finish chunk.
            chat = httpx.post(srv.base_url + "/chat/completions", json={"messages": MSG, "stream": True}, timeout=10)
    assert r.status_code == 200
    types = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert types[-1] == "error" and "message_stop" not in types[:-1]
    last = json.loads(r.text.strip().splitlines()[-1][6:])
    assert last["type"] == "error" and "message_stop" in last["error"]["message"]
    assert "stream_incomplete" in chat.text
