"""vLLM's memory verbs on a real gymserve around the tiny model (transformers engine): ``/sleep``
levels 1 and 2, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``, ``/abort_requests``; the
calls in flight end with ``abort``, calls that arrive while asleep wait, level 2 frees the weights'
storage and holds calls until new weights arrive. Every wait is bounded."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from gymserve.engine import sleep as sleep_mode
from gymserve.errors import NotSupportedError
from helpers.policy_weights import serve_tiny, weights_of


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tokenizer):
    srv = serve_tiny(tiny_model_dir, tokenizer, seed=99)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def original(tiny_model_dir):
    return weights_of(tiny_model_dir)


@pytest.fixture(scope="module")
def root(policy):
    return policy.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(policy):
    return openai.OpenAI(base_url=policy.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def awake(request, original):
    yield
    if "policy" in request.fixturenames:
        srv = request.getfixturevalue("policy")
        root = srv.base_url.removesuffix("/v1")
        httpx.post(f"{root}/wake_up", params={"tags": ["weights"]}, timeout=30)
        srv.update_weights(original)
        httpx.post(f"{root}/wake_up", timeout=30)


def post(root, path, **kw):
    return httpx.post(f"{root}{path}", timeout=60, **kw)


def tokens(client, max_tokens=6):
    msg = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=max_tokens
    )
    return msg.choices[0].finish_reason, (msg.choices[0].message.model_extra or {})["generation_token_ids"]


class Call(threading.Thread):
    def __init__(self, client, max_tokens=6):
        super().__init__(daemon=True)
        self.client, self.max_tokens, self.result, self.error = client, max_tokens, None, None
        self.start()

    def run(self):
        try:
            self.result = tokens(self.client, self.max_tokens)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc


def test_level_1_aborts_calls_in_flight_holds_new_ones_and_wakes(policy, client, root):
    before = tokens(client)
    long_call = Call(client, max_tokens=4000)
    deadline = time.monotonic() + 60
    while not policy.backend.engine._batch.active:
        assert time.monotonic() < deadline, "the long call never started"
        time.sleep(0.01)
    r = post(root, "/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "sleeping" and r.json()["level"] == 1 and r.json()["aborted"] == 1
    long_call.join(60)
    assert long_call.error is None and long_call.result[0] == "abort"
    assert httpx.get(f"{root}/is_sleeping", timeout=30).json() == {
        "is_sleeping": True,
        "level": 1,
        "weights_released": False,
    }
    assert httpx.get(f"{root}/health", timeout=30).json()["sleep"]["level"] == 1
    assert httpx.get(f"{root}/weight_info", timeout=30).json()["sleep_level"] == 1
    held = Call(client)
    held.join(1.0)
    assert held.is_alive(), "a call ran while the engine slept"
    r = post(root, "/wake_up")
    assert r.status_code == 200 and r.json() == {"status": "awake", "level": 0, "weights_released": False}
    held.join(60)
    assert held.error is None and held.result == before
    assert "sleep" not in httpx.get(f"{root}/health", timeout=30).json()


def test_level_2_releases_the_weights_until_new_ones_arrive(policy, client, root, original):
    before = tokens(client)
    model = policy.backend.engine.model
    r = post(root, "/sleep", json={"level": 2})  # SkyRL sends the level in the body
    assert r.status_code == 200 and r.json()["level"] == 2
    assert r.json()["bytes_released"] >= sum(t.numel() * t.element_size() for t in model.parameters())
    assert all(p.numel() == 0 for p in model.parameters())
    r = post(root, "/wake_up", params={"tags": ["kv_cache"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "weights_released"
    r = post(root, "/wake_up", params={"tags": ["weights"]})
    assert r.status_code == 200 and r.json()["weights_released"] is True
    assert model.get_parameter("model.norm.weight").shape == original["model.norm.weight"].shape
    r = post(root, "/wake_up")
    assert r.json() == {"status": "awake", "level": 0, "weights_released": True}
    held = Call(client)
    held.join(1.0)
    assert held.is_alive(), "a call ran on placeholder weights"
    policy.update_weights(original)
    held.join(60)
    assert held.error is None and held.result == before
    assert httpx.get(f"{root}/is_sleeping", timeout=30).json()["weights_released"] is False


def test_reset_prefix_cache_abort_requests_and_refusals(policy, client, root):
    r = post(root, "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"status": "ok", "cache_entries_dropped": 0}
    r = post(root, "/abort_requests", json={"request_ids": ["chatcmpl-1"]})
    assert r.status_code == 501 and "abort_all" in r.json()["error"]["message"]
    r = post(root, "/abort_requests", json={"abort_all": True})
    assert r.status_code == 200
    assert tokens(client)[0] in ("length", "stop")  # generation goes on after the abort
    r = post(root, "/sleep", params={"level": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    r = post(root, "/sleep", params={"level": 1}, json={"level": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    r = post(root, "/wake_up", params={"tags": ["gpu"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    r = post(root, "/sleep", json={"levle": 1})
    assert r.status_code == 400 and r.json()["error"]["param"].endswith("levle")


async def test_engines_without_a_worker_answer_501():
    class LibraryEngine:
        engine_name = "vllm"

    with pytest.raises(NotSupportedError, match="vllm engine"):
        await sleep_mode.sleep(LibraryEngine(), 1)
    with pytest.raises(NotSupportedError):
        await sleep_mode.reset_prefix_cache(LibraryEngine())
