"""The chat backend against a REAL third-party chat server: ``transformers serve`` on the embedded
model's safetensors copy, in its own virtual environment ``.venv-peer`` (built here when missing;
torch is installed first and pinned so pip never pulls a CUDA build). It stands in for a remote
vLLM started without parsers: no token IDs, raw text. Two short requests only (CPU, 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fakes import free_port

from gymserve.backends import RequestContext, build_backend
from gymserve.config import validate_config

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / ".venv-peer"
PEER_BIN = PEER / "bin" / "transformers"


def _build_peer_venv() -> str | None:
    """Create .venv-peer if needed; returns None on success or the reason it could not be built."""
    if PEER_BIN.exists():
        return None
    pip = str(PEER / "bin" / "pip")
    steps = [[sys.executable, "-m", "venv", str(PEER)],
             [pip, "install", "-q", "torch==2.13.0"],  # first and pinned: a looser torch pulls CUDA wheels
             [pip, "install", "-q", "transformers[serving]", "accelerate"]]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(step[:3])} failed: {exc}"
        if done.returncode != 0:
            return f"{' '.join(step[:3])} failed: {done.stderr.strip()[-300:]}"
    return None if PEER_BIN.exists() else "transformers CLI missing after install"


@pytest.fixture(scope="session")
def transformers_serve(embedded_dir):
    """``(base_url, model_name)`` of a running ``transformers serve`` (stopped at session end)."""
    reason = _build_peer_venv()
    if reason is not None:
        pytest.skip(f"cannot build .venv-peer for transformers serve: {reason}")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = open(ROOT / ".pytest_cache" / "transformers-serve.log", "w") if (ROOT / ".pytest_cache").is_dir() else subprocess.DEVNULL
    proc = subprocess.Popen([str(PEER_BIN), "serve", str(embedded_dir), "--port", str(port), "--host", "127.0.0.1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode} before answering /health")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("transformers serve did not become healthy within 300 s")
            time.sleep(1)
        yield url + "/v1", str(embedded_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not subprocess.DEVNULL:
            log.close()


async def test_chat_and_responses_through_transformers_serve(transformers_serve):
    base_url, model = transformers_serve
    backend = build_backend(validate_config({"backend": {
        "type": "chat", "base_urls": base_url, "model": model, "served_model_name": "policy", "timeout": 120}}))
    try:
        assert model in await backend.upstream_models()
        out = await backend.chat({"model": "policy", "messages": [{"role": "user", "content": "Say hi"}],
                                  "max_tokens": 4, "temperature": 0}, RequestContext(session_id="s"))
        choice = out["choices"][0]
        assert out["model"] == "policy" and choice["finish_reason"] in ("stop", "length")
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
        resp = await backend.responses({"model": "policy", "input": "Say hi", "max_output_tokens": 8,
                                        "temperature": 0}, RequestContext(session_id="s"))
        assert resp["status"] in ("completed", "incomplete") and resp["output"][-1]["type"] == "message"
        assert resp["output"][-1]["content"][0]["text"]
    finally:
        await backend.close()
