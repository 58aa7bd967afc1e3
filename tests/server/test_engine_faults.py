"""An engine fault is an error, not a dead server (issue #24): a worker thread that dies on an
exception leaves the engine ``down`` — every call in flight and every later call answers 503
``engine_down`` naming the engine and the cause, ``/health`` says ``down`` with the reason — and
SIGTERM still stops the server. A pause timeout the OS cannot wait for is a 400, and the worker
lives on. The fault is injected through the engine seam: ``helpers.faulty_engine.FaultyEngine`` is a
real ``WorkerEngine`` whose loop raises after a few steps."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, SamplingConfig, validate_config
from gymserve.engine.worker import WorkerEngine
from gymserve.server.run import start_background_server
from helpers.fakes import free_port
from helpers.faulty_engine import FaultyEngine

HI = [{"role": "user", "content": "hi"}]
TESTS = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _server(tokenizer, engine):
    config = LocalBackendConfig(model="faulty", sampling=SamplingConfig(temperature=0.0))
    cfg = validate_config({"server": {"port": 0}, "backend": config.model_dump()})
    with start_background_server(cfg, backend_factory=lambda: LocalBackend(config, engine, tokenizer)) as srv:
        yield srv, srv.base_url.removesuffix("/v1")


def _chat(root: str, max_tokens: int = 50, **kw) -> httpx.Response:
    return httpx.post(
        root + "/v1/chat/completions",
        json={"model": "faulty", "messages": HI, "max_tokens": max_tokens, **kw},
        timeout=60,
    )


def _assert_engine_down(r: httpx.Response, step: int) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_down"
    assert err["message"].startswith("the faulty engine is down: it stopped on ")
    assert f"RuntimeError: injected fault in step {step}" in err["message"]


def test_a_worker_that_dies_mid_call_takes_the_engine_down_with_an_error_for_everyone(tokenizer):
    engine = FaultyEngine(tokenizer, fail_after=3)
    with _server(tokenizer, engine) as (_, root):
        assert httpx.get(root + "/health").json()["status"] == "ok"
        # In flight when the worker dies (step 4 of 50): the caller gets the error, not a hang.
        _assert_engine_down(_chat(root), step=4)
        assert not engine._thread.is_alive() or engine.fault is not None
        assert engine.fault == "RuntimeError: injected fault in step 4"
        # Every later call, streamed or not, and every control command: the same error.
        _assert_engine_down(_chat(root), step=4)
        streamed = _chat(root, stream=True)
        _assert_engine_down(streamed, step=4)
        _assert_engine_down(httpx.post(root + "/pause", params={"mode": "keep"}, timeout=30), step=4)
        _assert_engine_down(httpx.post(root + "/resume", timeout=30), step=4)
        health = httpx.get(root + "/health")
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "down" and body["engine"] == "faulty"
        assert body["reason"].startswith("the faulty engine stopped on RuntimeError: injected fault in step 4")
        assert engine.steps == 4  # nothing ran after the fault


def test_a_stream_in_flight_ends_with_the_error_event(tokenizer):
    """A stream has answered 200 before the fault: it ends with an ``error`` event carrying the
    error object, and never with a finish reason (an answer that did not finish never looks finished)."""
    engine = FaultyEngine(tokenizer, fail_after=3)
    with _server(tokenizer, engine) as (_, root):
        r = _chat(root, stream=True)
        assert r.status_code == 200
        events = [line for line in r.text.splitlines() if line.startswith(("data: ", "event: "))]
        assert events[-3:-1] == ["event: error", events[-2]] and events[-1] == "data: [DONE]"
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert err["code"] == "engine_down" and "RuntimeError: injected fault in step 4" in err["message"]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {") and "choices" in e]
        assert len(chunks) == 4  # the role chunk and the three tokens sampled before the fault
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_concurrent_calls_in_flight_all_get_the_error(tokenizer):
    engine = FaultyEngine(tokenizer, fail_after=6, delay=0.1)
    with _server(tokenizer, engine) as (_, root):
        out: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: out.append(_chat(root, max_tokens=200))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(out) == 3
        for r in out:
            _assert_engine_down(r, step=7)


def test_a_pause_of_1e300_seconds_is_a_400_and_the_worker_lives_on(tokenizer):
    engine = FaultyEngine(tokenizer, fail_after=None, delay=0.0)
    with _server(tokenizer, engine) as (_, root):
        for timeout in ("1e300", "86401", "inf", "nan"):
            r = httpx.post(root + "/pause", params={"mode": "keep", "timeout": timeout}, timeout=30)
            assert r.status_code == 400, (timeout, r.text)
            assert r.json()["error"]["param"] == "query.timeout" or r.json()["error"]["param"] == "timeout", r.text
        assert httpx.get(root + "/is_paused").json()["is_paused"] is False
        # The longest pause allowed (one day) is taken, and /resume ends it.
        r = httpx.post(root + "/pause", params={"mode": "keep", "timeout": "86400"}, timeout=30)
        assert r.status_code == 200 and r.json()["timeout"] == 86400
        assert 86000 < httpx.get(root + "/is_paused").json()["seconds_left"] <= 86400
        assert httpx.post(root + "/resume", timeout=30).status_code == 200
        done = _chat(root, max_tokens=5)
        assert done.status_code == 200, done.text
        assert done.json()["choices"][0]["finish_reason"] == "length"
        assert engine._thread.is_alive() and engine.fault is None
        assert httpx.get(root + "/health").json()["status"] == "ok"


def test_the_worker_waits_past_the_os_deadline_limit_without_raising():
    """``queue.get(timeout=1e300)`` raises OverflowError (the OS cannot wait that long); the worker's
    pull waits in bounded steps instead, and still returns an item that arrives."""
    w = WorkerEngine.__new__(WorkerEngine)
    w._inbox = queue.Queue()
    threading.Timer(0.3, w._inbox.put, args=("item",)).start()
    assert w._pull(block=True, timeout=1e300) == ["item"]
    with pytest.raises(OverflowError):
        queue.Queue().get(timeout=1e300)


SERVE = """
import sys
from transformers import AutoTokenizer
from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig, validate_config
from gymserve.server.run import run_event_loop, serve_async
from helpers.faulty_engine import FaultyEngine

tok = AutoTokenizer.from_pretrained(sys.argv[1])
config = LocalBackendConfig(model="faulty")
cfg = validate_config({"server": {"host": "127.0.0.1", "port": int(sys.argv[2])}, "backend": config.model_dump()})
run_event_loop(serve_async(cfg, LocalBackend(config, FaultyEngine(tok, fail_after=2), tok)))
print("exited cleanly", flush=True)
"""


def test_sigterm_stops_a_server_whose_engine_died(tmp_path, embedded_dir):
    port = free_port()
    script = tmp_path / "serve_faulty.py"
    script.write_text(SERVE)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(embedded_dir), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(root + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(0.2)
        _assert_engine_down(_chat(root), step=3)
        assert httpx.get(root + "/health").json()["status"] == "down"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "exited cleanly" in text
    assert "the faulty engine's worker thread died" in text  # the log has it, with the traceback
    assert "RuntimeError: injected fault in step 3" in text
