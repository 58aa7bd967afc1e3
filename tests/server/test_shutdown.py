"""Graceful shutdown: on SIGTERM, ``gymserve serve`` stops accepting connections, answers a
request that still reaches it with 503 ``shutting_down``, lets in-flight requests finish (at most
``server.shutdown_timeout`` seconds), closes the backend and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gymserve.config import validate_config
from gymserve.server.run import start_background_server
from helpers.fakes import ChatScript, FakeServer, completion, free_port

MSG = [{"role": "user", "content": "hi"}]


def _slow(seconds: float):
    async def answer(r):
        await asyncio.sleep(seconds)
        return 200, completion("finished")

    return ChatScript(default=answer)


def _serve(upstream_url: str, tmp_path, **server) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = tmp_path / "gymserve.yaml"
    lines = ["server:", "  host: 127.0.0.1", f"  port: {port}"] + [f"  {k}: {v}" for k, v in server.items()]
    lines += ["backend:", "  type: chat", f"  base_urls: [{upstream_url}/v1]", "  model: policy", "  max_retries: 0"]
    cfg.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gymserve.cli", "serve", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gymserve serve did not start: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(0.1)


def _in_background(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def _post(base):
    try:
        return httpx.post(base + "/v1/chat/completions", json={"messages": MSG}, timeout=30)
    except httpx.TransportError as exc:
        return exc


def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones(tmp_path):
    with FakeServer(_slow(1.5)) as up:
        capture = tmp_path / "capture.jsonl"
        proc, base = _serve(up.url, tmp_path, capture_path=str(capture))
        try:
            threads = [_in_background(lambda: _post(base)) for _ in range(3)]
            deadline = time.monotonic() + 10
            while len(up.chat_requests()) < 3:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            # New connections are refused while the old ones drain.
            with pytest.raises(httpx.TransportError):
                httpx.post(base + "/v1/chat/completions", json={"messages": MSG}, timeout=5)
            for t, out in threads:
                t.join(20)
                assert isinstance(out[0], httpx.Response) and out[0].status_code == 200, out
                assert out[0].json()["choices"][0]["message"]["content"] == "finished"
            assert proc.wait(20) == 0
            assert time.monotonic() - t0 < 10
            assert len(up.chat_requests()) == 3
            # The backend was closed and the capture flushed before exit: every finished call is there.
            assert [line.count('"status":200') for line in capture.read_text().splitlines()] == [1, 1, 1]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_shutdown_is_bounded_by_shutdown_timeout(tmp_path):
    with FakeServer(_slow(30)) as up:
        proc, base = _serve(up.url, tmp_path, shutdown_timeout=1)
        try:
            t, out = _in_background(lambda: _post(base))
            deadline = time.monotonic() + 10
            while not up.chat_requests():
                assert time.monotonic() < deadline
                time.sleep(0.02)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
            assert time.monotonic() - t0 < 6  # 1 s grace + closing, not the upstream's 30 s
            t.join(10)
            assert out and not (isinstance(out[0], httpx.Response) and out[0].status_code == 200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_draining_server_answers_503_and_health_says_so():
    with FakeServer(ChatScript()) as up:
        cfg = validate_config({"server": {"port": 0}, "backend": {"type": "chat", "base_urls": [up.url + "/v1"]}})
        with start_background_server(cfg) as srv:
            with httpx.Client(base_url=srv.base_url) as client:  # a kept-alive connection
                assert client.post("/chat/completions", json={"messages": MSG}).status_code == 200
                srv.app.state.draining = True
                r = client.post("/chat/completions", json={"messages": MSG})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "shutting_down"
                assert client.post("/responses", json={"input": "x"}).status_code == 503
                assert client.get(srv.base_url.removesuffix("/v1") + "/health").json() == {"status": "draining"}
            assert len(up.chat_requests()) == 1
