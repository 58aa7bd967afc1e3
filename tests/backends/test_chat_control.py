"""The chat backend as a training gateway (``backends.chat_control``): a real gymserve on 127.0.0.1
in front of fake vLLM and SGLang servers that speak their control APIs exactly
(``helpers.fake_control``), the official openai SDK and httpx as clients.

Pauses hold the rollouts' calls at the gateway and never drop or fail them; an abort pause ends the
calls in flight with what they generated, marked ``abort``; a wait pause returns once they
finished; control calls are forwarded to each flavour's own endpoints with the exact URL, query,
headers and body; what a flavour lacks answers 501 naming it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time

import httpx
import openai
import pytest
from safetensors.torch import save_file

from helpers.fake_control import FakeSGLang, FakeVLLM, routes

CONTROL_KEY = "ctl-secret"
MSG = [{"role": "user", "content": "Hi"}]
WAIT = 60


def _root(srv) -> str:
    return srv.base_url.removesuffix("/v1")


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=WAIT)


def _wait(predicate, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------------------ pause at the door
def test_keep_pause_holds_new_calls_and_resume_lets_them_all_through(gateway):
    up = FakeVLLM(tokens=3, delay=0.001)
    srv, fake = gateway(up)  # no flavour: the gateway alone
    root, client = _root(srv), _client(srv)
    r = httpx.post(root + "/pause", params={"mode": "keep", "timeout": 30})
    assert r.status_code == 200 and r.json()["status"] == "paused"
    assert httpx.get(root + "/is_paused").json() == {
        "is_paused": True,
        "mode": "keep",
        "seconds_left": pytest.approx(30, abs=2),
    }
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client.chat.completions.create, model="policy", messages=MSG) for _ in range(6)]
        time.sleep(0.5)
        assert not any(f.done() for f in futures) and not fake.chat_requests()  # held, nothing sent upstream
        health = httpx.get(root + "/health").json()
        assert health["paused"] == "keep" or health["replicas_control"][0]["paused"] == "keep"
        assert httpx.post(root + "/resume").json() == {"status": "resumed"}
        answers = [f.result(timeout=WAIT) for f in futures]
    assert all(a.choices[0].finish_reason == "stop" and a.choices[0].message.content == "w0 w1 w2 " for a in answers)
    assert routes(fake) == []  # nothing forwarded without a flavour


def test_held_calls_are_bounded_and_a_pause_ends_at_its_deadline(gateway, caplog):
    srv, fake = gateway(FakeVLLM(tokens=2, delay=0.001), max_queue=2)
    root = _root(srv)
    assert httpx.post(root + "/pause", params={"mode": "abort", "timeout": 1.5}).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(3) as pool, caplog.at_level(logging.WARNING, "gymserve.pause"):
        held = [
            pool.submit(httpx.post, root + "/v1/chat/completions", json={"messages": MSG}, timeout=WAIT)
            for _ in range(2)
        ]
        _wait(lambda: srv.backend.gate.waiting == 2, "two held calls")
        over = httpx.post(root + "/v1/chat/completions", json={"messages": MSG}, timeout=WAIT)
        assert over.status_code == 429 and over.headers["retry-after"]
        assert "max_queue=2" in over.json()["error"]["message"]
        answers = [f.result(timeout=WAIT) for f in held]  # the deadline lets them through
    assert [a.status_code for a in answers] == [200, 200]
    assert "reached its deadline of 1.5 s without resume_generation; resuming by itself" in caplog.text
    assert httpx.get(root + "/is_paused").json()["is_paused"] is False


def test_abort_ends_calls_in_flight_with_what_was_streamed(gateway):
    srv, fake = gateway(FakeVLLM(tokens=400, delay=0.01))  # the gateway alone must cut them
    root, client = _root(srv), _client(srv)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.chat.completions.create, model="policy", messages=MSG)
        pieces: list[str] = []

        def stream():
            for chunk in client.chat.completions.create(model="policy", messages=MSG, stream=True):
                choice = chunk.choices[0]
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    return choice.finish_reason

        streamed = pool.submit(stream)
        _wait(lambda: len(pieces) >= 3, "a few streamed words")
        assert httpx.post(root + "/pause", params={"mode": "abort"}).status_code == 200
        assert streamed.result(timeout=WAIT) == "abort"
        answer = whole.result(timeout=WAIT)
    assert 3 <= len(pieces) < 400 and "".join(pieces).startswith("w0 w1 w2 ")
    assert answer.choices[0].finish_reason == "abort" and not answer.choices[0].message.content
    httpx.post(root + "/resume")


def test_wait_pause_returns_once_calls_in_flight_finished_or_409_at_its_deadline(gateway):
    srv, fake = gateway(FakeVLLM(tokens=60, delay=0.02))
    root, client = _root(srv), _client(srv)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.chat.completions.create, model="policy", messages=MSG)
        _wait(lambda: fake.handler.in_flight == 1, "the call in flight")
        r = httpx.post(root + "/pause", params={"mode": "wait", "timeout": 30}, timeout=WAIT)
        # Returned once the call had its whole answer from upstream (the client may still be reading it).
        assert r.status_code == 200 and fake.handler.in_flight == 0
        assert call.result(timeout=WAIT).choices[0].finish_reason == "stop"
    httpx.post(root + "/resume")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.chat.completions.create, model="policy", messages=MSG)
        _wait(lambda: fake.handler.in_flight == 1, "the call in flight")
        r = httpx.post(root + "/pause", params={"mode": "wait", "timeout": 0.2}, timeout=WAIT)
        assert r.status_code == 409 and r.json()["error"]["code"] == "pause_ended"
        assert call.result(timeout=WAIT).choices[0].finish_reason == "stop"  # never dropped


# ------------------------------------------------------------------------------ vLLM
def test_vllm_flavour_forwards_every_operation_exactly(gateway, tmp_path):
    import torch

    up = FakeVLLM(tokens=3, delay=0.001, api_key=CONTROL_KEY)
    srv, fake = gateway(up, "vllm", api_key=CONTROL_KEY)
    root = _root(srv)
    for mode in ("abort", "wait", "keep"):
        assert httpx.post(root + "/pause", params={"mode": mode}).status_code == 200
        assert up.paused == mode
    assert httpx.post(root + "/resume").status_code == 200 and up.paused is None
    pauses = [r for r in fake.requests if r.path == "/pause"]
    assert [r.query for r in pauses] == [{"mode": "abort"}, {"mode": "wait"}, {"mode": "keep"}]
    assert all(r.body is None and r.headers["authorization"] == f"Bearer {CONTROL_KEY}" for r in pauses)

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    fake.requests.clear()
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}, "weight_version": "step-1"})
    assert r.status_code == 200 and r.json()["weight_version"] == "step-1", r.text
    assert routes(fake) == [
        ("GET", "/server_info"),  # which weight transfer the server has: disk
        ("POST", "/start_weight_update"),
        ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"),
    ]
    assert [r.body for r in fake.requests] == [
        None,
        None,
        {"update_info": {"path": str(tmp_path)}},
        {"weight_version": "step-1"},
    ]
    assert fake.requests[0].query == {"config_format": "json"}
    assert up.weight_version == "step-1"
    # Versions the gateway counts itself go out as strings (vLLM's type) and read back from /weight_info.
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}})
    assert r.json()["weight_version"] == 2 and up.weight_version == "2"
    assert httpx.post(root + "/update_weight_version", json={"new_version": 7}).status_code == 200
    assert fake.requests[-1].body == {"new_version": "7"} and up.weight_version == "7"
    health = httpx.get(root + "/health").json()
    assert fake.requests[-1].path == "/weight_info" and health["weight_version"] == "7"
    assert 'gymserve_weight_version_info{backend="chat",replica="' in httpx.get(root + "/metrics").text

    # A path the disk transfer refuses: vLLM's bare 500, reported as a 502 naming the URL.
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": "relative/dir"}})
    assert r.status_code == 502 and f"{fake.url}/update_weights failed (500)" in r.json()["error"]["message"]

    fake.requests.clear()
    body = {"lora_name": "policy", "lora_path": "/adapters/step-3", "load_inplace": True}
    r = httpx.post(root + "/v1/load_lora_adapter", json=body)
    assert r.status_code == 200, r.text
    assert [(x.path, x.body) for x in fake.requests] == [("/v1/load_lora_adapter", body)]
    assert up.loras == {"policy": "/adapters/step-3"}
    r = httpx.post(root + "/v1/load_lora_adapter", json={**body, "load_inplace": False})
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    assert httpx.post(root + "/v1/unload_lora_adapter", json={"lora_name": "policy"}).status_code == 200
    r = httpx.post(root + "/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    assert CONTROL_KEY not in httpx.get(root + "/health").text


def test_vllm_abort_is_done_by_the_server_and_its_partial_answers_pass_through(gateway):
    up = FakeVLLM(tokens=400, delay=0.01)
    srv, fake = gateway(up, "vllm")
    root, client = _root(srv), _client(srv)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.chat.completions.create, model="policy", messages=MSG)
        _wait(lambda: up.in_flight == 1, "the call in flight")
        time.sleep(0.1)
        assert httpx.post(root + "/pause", params={"mode": "abort"}).status_code == 200
        answer = call.result(timeout=WAIT)
    assert answer.choices[0].finish_reason == "abort"
    assert answer.choices[0].message.content.startswith("w0 ")  # what the server generated is kept
    assert up.finished == ["abort"]
    httpx.post(root + "/resume")


def test_a_server_without_the_control_endpoints_gives_501_and_no_pause(gateway):
    from helpers.fakes import ChatScript

    srv, fake = gateway(ChatScript(), "vllm")  # a plain chat server: every control route is 404
    root = _root(srv)
    r = httpx.post(root + "/pause", params={"mode": "keep"})
    assert r.status_code == 501 and r.json()["error"]["code"] == "control_not_supported"
    assert (
        "VLLM_SERVER_DEV_MODE=1" in r.json()["error"]["message"] and f"{fake.url}/pause" in r.json()["error"]["message"]
    )
    assert httpx.get(root + "/is_paused").json()["is_paused"] is False  # the gateway let go again
    assert httpx.post(root + "/v1/chat/completions", json={"messages": MSG}).status_code == 200


def test_without_a_flavour_weight_operations_are_501_naming_the_setting(gateway, tmp_path):
    srv, fake = gateway(FakeVLLM(tokens=1))
    root = _root(srv)
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}})
    assert r.status_code == 501 and "update_weights" in r.json()["error"]["message"]
    assert "backend.upstream_control" in r.json()["error"]["message"]
    r = httpx.post(root + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 501 and "load_lora_adapter" in r.json()["error"]["message"]
    assert routes(fake) == []


# ------------------------------------------------------------------------------ SGLang
def test_sglang_flavour_forwards_every_operation_exactly(gateway, tmp_path):
    up = FakeSGLang(tokens=3, delay=0.001, api_key=CONTROL_KEY)
    srv, fake = gateway(up, "sglang", control_api_key=CONTROL_KEY, api_key="other")
    root = _root(srv)
    fake.handler.api_key = None  # the chat routes take the other key; control routes are checked below
    assert httpx.post(root + "/pause", params={"mode": "abort"}).status_code == 200
    assert httpx.post(root + "/pause", params={"mode": "keep"}).status_code == 200
    assert httpx.post(root + "/pause", params={"mode": "wait"}).status_code == 200
    assert httpx.post(root + "/resume").status_code == 200
    sent = [(r.path, r.body) for r in fake.requests if r.path != "/v1/models"]
    assert sent == [
        ("/pause_generation", {"mode": "abort"}),
        ("/pause_generation", {"mode": "retract"}),
        ("/pause_generation", {"mode": "retract"}),
        ("/continue_generation", {}),
    ]
    assert all(r.headers["authorization"] == f"Bearer {CONTROL_KEY}" for r in fake.requests if r.path != "/v1/models")

    fake.requests.clear()
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}, "weight_version": "s1"})
    assert r.status_code == 200, r.text
    assert [(x.path, x.body) for x in fake.requests] == [
        ("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "s1"})
    ]
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": "/no/such/dir"}})
    assert r.status_code == 400 and "Failed to get weights iterator" in r.json()["error"]["message"]
    assert up.weight_version == "s1"
    assert httpx.get(root + "/weight_info").json()["weight_version"] == "s1"
    fake.requests.clear()
    assert httpx.get(root + "/health").json()["weight_version"] == "s1"
    assert [r.path for r in fake.requests if r.path != "/v1/models"] == ["/model_info"]

    fake.requests.clear()
    body = {"lora_name": "policy", "lora_path": "/adapters/a"}
    assert httpx.post(root + "/v1/load_lora_adapter", json=body).status_code == 200
    r = httpx.post(root + "/v1/load_lora_adapter", json=body)
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    # In place: SGLang has no such flag, so the name is unloaded first, then loaded again.
    assert (
        httpx.post(
            root + "/v1/load_lora_adapter", json={**body, "lora_path": "/adapters/b", "load_inplace": True}
        ).status_code
        == 200
    )
    assert up.loras == {"policy": "/adapters/b"}
    assert [(x.path, x.body) for x in fake.requests][-2:] == [
        ("/unload_lora_adapter", {"lora_name": "policy"}),
        ("/load_lora_adapter", {"lora_name": "policy", "lora_path": "/adapters/b"}),
    ]
    assert httpx.post(root + "/v1/unload_lora_adapter", json={"lora_name": "policy"}).status_code == 200
    r = httpx.post(root + "/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert r.status_code == 400 and "is not loaded" in r.json()["error"]["message"]


def test_sglang_wait_pause_drains_at_the_gateway_then_retracts(gateway):
    up = FakeSGLang(tokens=40, delay=0.02)
    srv, fake = gateway(up, "sglang")
    root, client = _root(srv), _client(srv)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.chat.completions.create, model="policy", messages=MSG)
        _wait(lambda: up.in_flight == 1, "the call in flight")
        r = httpx.post(root + "/pause", params={"mode": "wait"}, timeout=WAIT)
        assert r.status_code == 200 and call.done() and call.result().choices[0].finish_reason == "stop"
    pause = [r for r in fake.requests if r.path == "/pause_generation"]
    assert [p.body for p in pause] == [{"mode": "retract"}] and up.paused == "retract"
    httpx.post(root + "/resume")
    assert up.paused is None


def test_stream_abort_with_token_ids_keeps_the_training_fields(gateway):
    """With return_token_id_information, an aborted stream's last chunk carries the token fields of
    what was streamed (vLLM's token_ids on each chunk, prompt_token_ids on the first)."""
    import asyncio

    from starlette.responses import StreamingResponse

    from helpers.fakes import Recorded

    state = {"sent": 0}

    async def handler(r: Recorded):
        if r.path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "policy"}]}
        assert r.body["return_token_ids"] is True and r.body["return_tokens_as_token_ids"] is True

        async def events():
            head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "policy"}
            first = {
                **head,
                "prompt_token_ids": [1, 2, 3],
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
            yield f"data: {json.dumps(first)}\n\n"
            for i in range(1000):
                await asyncio.sleep(0.01)
                state["sent"] += 1
                lp = {"content": [{"token": f"token_id:{100 + i}", "logprob": -0.5, "bytes": None, "top_logprobs": []}]}
                chunk = {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": f"t{i}"},
                            "token_ids": [100 + i],
                            "logprobs": lp,
                            "finish_reason": None,
                        }
                    ],
                }
                yield f"data: {json.dumps(chunk)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    srv, fake = gateway(handler, return_token_id_information=True)
    root = _root(srv)
    final: dict = {}

    def stream():
        with httpx.stream(
            "POST", root + "/v1/chat/completions", json={"messages": MSG, "stream": True}, timeout=WAIT
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                        final.update(chunk["choices"][0])

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        _wait(lambda: state["sent"] >= 5, "five streamed tokens")
        assert httpx.post(root + "/pause", params={"mode": "abort"}).status_code == 200
        done.result(timeout=WAIT)
    assert final["finish_reason"] == "abort"
    delta = final["delta"]
    n = len(delta["generation_token_ids"])
    assert n >= 5 and delta["prompt_token_ids"] == [1, 2, 3]
    assert delta["generation_token_ids"] == list(range(100, 100 + n)) and delta["generation_log_probs"] == [-0.5] * n
    httpx.post(root + "/resume")


def test_vllm_without_a_disk_transfer_reloads_through_collective_rpc(gateway, tmp_path):
    """vLLM 0.32 has no disk weight transfer: the gateway sees none in /server_info and reloads the
    checkpoint with /collective_rpc reload_weights, then names the version; never /start_weight_update
    (a bare 500 there). A directory vLLM cannot load is a 400 naming it, and the version is read back."""
    import torch

    up = FakeVLLM(tokens=3, delay=0.001, transfer=None)
    up.weight_version = "default"  # vLLM >= 0.32 before any named update
    srv, fake = gateway(up, "vllm")
    root, client = _root(srv), _client(srv)
    first = client.chat.completions.create(model="policy", messages=MSG).choices[0].message.model_extra
    assert first["weight_version"] == "default"
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    fake.requests.clear()
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}, "weight_version": "s1"})
    assert r.status_code == 200, r.text
    assert [(x.method, x.path, x.body) for x in fake.requests] == [
        ("GET", "/server_info", None),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}),
        ("POST", "/update_weight_version", {"new_version": "s1"}),
    ]
    assert up.loaded_path == str(tmp_path) and up.weight_version == "s1"
    assert (
        client.chat.completions.create(model="policy", messages=MSG).choices[0].message.model_extra["weight_version"]
        == "s1"
    )
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": "/nonexistent/ckpt"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        "vLLM could not reload weights from /nonexistent/ckpt" in err["message"] and err["param"] == "update_info.path"
    )
    assert (
        "vLLM still answers GET /health, but a failed reload can leave its engine unable to generate" in err["message"]
    )
    # Nothing changed on the server, and the gateway says so: the version read back, not null.
    after = client.chat.completions.create(model="policy", messages=MSG).choices[0].message.model_extra
    assert after["weight_version"] == "s1"
