"""Streaming over the local backend, driven by the official SDK's streaming helpers: the accumulated
result equals the non-streamed call for the same request (seeded sampling: each request reseeds, so both
calls sample the same tokens; tiny model, on each in-process CPU engine)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import GymserveConfig, LocalBackendConfig, SamplingConfig, ServerConfig
from gymserve.server.run import start_background_server
from helpers.spec import assert_valid_event, assert_valid_response

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
# How far the log-probs of two identical seeded calls may differ. The transformers engine computes
# each call alike: bit for bit. llamacpp serves the repeat from the first call's cached KV, so the
# last prompt token runs in a batch of its own instead of inside the prompt's, and llama.cpp's
# kernels round that ~1e-8 differently; the token IDs stay exact.
SAME_CALL_LOG_PROB_TOL = {"transformers": 0.0, "llamacpp": 1e-6}


@pytest.fixture(scope="module")
def server(local_engine):
    engine, model = local_engine
    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=LocalBackendConfig(model=str(model), engine=engine, sampling=SamplingConfig(temperature=1.0, seed=7)),
    )
    srv = start_background_server(cfg, backend_factory=lambda: LocalBackend.from_config(cfg.backend))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tol(local_engine) -> float:
    return SAME_CALL_LOG_PROB_TOL[local_engine[0]]


def _same_log_probs(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_chat_stream_equals_non_streamed(client, tol):
    msgs = [{"role": "user", "content": "Write something"}]
    full = client.chat.completions.create(model="t", messages=msgs, max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model="t", messages=msgs, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    extra = finals[0].choices[0].delta.model_extra
    want = full.choices[0].message.model_extra
    assert extra["prompt_token_ids"] == want["prompt_token_ids"]
    assert extra["generation_token_ids"] == want["generation_token_ids"]
    assert _same_log_probs(extra["generation_log_probs"], want["generation_log_probs"], tol)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_responses_stream_final_equals_non_streamed(client, tol):
    kwargs = dict(model="t", input="Tell me a story", max_output_tokens=10)
    full = client.responses.create(**kwargs).model_dump()
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    # The SDK's get_final_response() only accepts response.completed; an incomplete response (as
    # the OpenAI API also ends a max_output_tokens stream) is carried by the last event.
    final = events[-1].response.model_dump()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"  # max_output_tokens reached
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for key in ("status", "incomplete_details", "usage"):
        assert final[key] == full[key]
    strip = lambda items: [  # noqa: E731
        {k: v for k, v in it.items() if k not in ("id", "generation_log_probs")} for it in items
    ]
    assert strip(final["output"]) == strip(full["output"])
    for got, want in zip(final["output"], full["output"]):
        assert _same_log_probs(got.get("generation_log_probs") or [], want.get("generation_log_probs") or [], tol)
    assert final["output"][-1]["generation_token_ids"] == full["output"][-1]["generation_token_ids"]


def test_raw_responses_events_validate_against_spec(server):
    body = {"model": "t", "input": "hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        import json

        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for ev in events:
        assert_valid_event(ev)
    assert_valid_response(events[-1]["response"])


def test_stream_bad_request_is_plain_400(server):
    body = {"model": "t", "messages": [{"role": "user", "content": "x"}], "n": 200, "stream": True}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_time_to_first_event_is_before_generation_ends(client):
    """The first delta arrives before the whole generation would have finished."""
    msgs = [{"role": "user", "content": "Count"}]
    t0 = time.perf_counter()
    client.chat.completions.create(model="t", messages=msgs, max_tokens=64)
    total = time.perf_counter() - t0
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="t", messages=msgs, max_tokens=64, stream=True)
    first_content = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first_content = time.perf_counter() - t0
            break
    stream.close()
    assert first_content is not None and first_content < total
