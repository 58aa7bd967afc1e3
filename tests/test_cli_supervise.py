"""``gymserve serve`` under its supervising parent (``gymserve.cli.supervise``): a native crash in
the server process (a real SIGSEGV, faulthandler's backtrace) becomes one line and exit 139; SIGTERM
reaches the server through the parent; killing the parent leaves no server behind (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from gymserve.cli.supervise import CHILD_ENV, describe_death
from helpers.fakes import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals, PR_SET_PDEATHSIG")

# Loaded by the server process only (sitecustomize runs at every interpreter start): once
# `gymserve serve` has set up (faulthandler on), wait CRASH_AFTER s and read address 0, as a
# llama.cpp kernel bug would.
CRASH = """
import os, threading
if os.environ.get("GYMSERVE_SERVE_CHILD") and os.environ.get("CRASH_AFTER"):
    import ctypes, faulthandler, time

    def crash():
        deadline = time.monotonic() + 60
        while not faulthandler.is_enabled() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(float(os.environ["CRASH_AFTER"]))
        ctypes.string_at(0)

    threading.Thread(target=crash, daemon=True).start()
"""


def _serve(tmp_path, **env) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = tmp_path / "gymserve.yaml"
    cfg.write_text(
        f"server:\n  host: 127.0.0.1\n  port: {port}\n"
        "backend:\n  type: chat\n  base_urls: [http://127.0.0.1:9/v1]\n  model: policy\n  max_retries: 0\n"
    )
    (tmp_path / "sitecustomize.py").write_text(CRASH)
    pythonpath = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    environ = {k: v for k, v in os.environ.items() if k != CHILD_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gymserve.cli", "serve", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **env},
    )
    return proc, f"http://127.0.0.1:{port}"


def _wait_serving(proc: subprocess.Popen, root: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(root + "/health", timeout=1)
            return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gymserve serve did not start: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.1)


def test_a_native_crash_in_the_server_is_one_line_and_exit_139(tmp_path):
    proc, root = _serve(tmp_path, CRASH_AFTER="1")
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.decode()
    assert proc.returncode == 128 + signal.SIGSEGV, text[-3000:]
    assert "Fatal Python error: Segmentation fault" in text  # faulthandler, in the server process
    last = text.strip().splitlines()[-1]
    assert last.startswith("gymserve serve: the server process (pid ")
    assert "died of SIGSEGV: a crash in native code" in last
    assert "the Python backtrace of every thread (faulthandler) is just above, on stderr" in last


def test_sigterm_reaches_the_server_through_the_parent(tmp_path):
    proc, root = _serve(tmp_path)
    try:
        _wait_serving(proc, root)
        [child] = psutil.Process(proc.pid).children()
        assert child.environ().get(CHILD_ENV) == "1"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killing_the_parent_stops_the_server(tmp_path):
    proc, root = _serve(tmp_path)
    try:
        _wait_serving(proc, root)
        [child] = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait()
        child.wait(timeout=60)  # PR_SET_PDEATHSIG: SIGTERM, a graceful shutdown
        with pytest.raises(httpx.TransportError):
            httpx.get(root + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_describe_death():
    assert describe_death(0, 7) is None and describe_death(2, 7) is None
    kill9 = describe_death(-9, 7)
    assert kill9 is not None and "died of SIGKILL" in kill9 and "no backtrace" in kill9
    illegal = describe_death(-int(signal.SIGILL), 7)
    assert illegal is not None and "an instruction this CPU lacks" in illegal
