"""Every answer of the chat gateway names the weight version that generated it
(``backends.chat_versions``): a real gymserve on 127.0.0.1 as the gateway, the official openai and
anthropic SDKs as clients, and behind it either fake vLLM/SGLang servers that speak their APIs
exactly (``helpers.fake_control``: the gateway stamps what it forwarded or read) or a real gymserve
on the tiny model (it names its versions and spans itself, and they pass through), with updates
forwarded mid-generation in each pause mode and every reported log-prob teacher-forced on the
weights of the version named for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from gymserve.harness.verify import load_model
from helpers.fake_control import FakeSGLang, FakeVLLM
from helpers.policy_weights import check_teacher_forced, noisy, serve_tiny, weights_of

MSG = [{"role": "user", "content": "Hi"}]
WAIT = 120
APIS = (
    "chat",
    "chat stream",
    "responses",
    "responses stream",
    "messages",
    "messages stream",
    "completions",
    "completions stream",
)


def _root(srv) -> str:
    return srv.base_url.removesuffix("/v1")


def _openai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=WAIT)


def _anthropic(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=_root(srv), api_key="unused", max_retries=0, timeout=WAIT)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _checkpoint(path) -> str:
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    return str(path)


# ------------------------------------------------------------------------------ reading the fields
def chat_final(chunks: list) -> tuple[str, dict]:
    """A chat stream's finish reason and the extra fields of its finish chunk's delta."""
    last = next(c.choices[0] for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    return last.finish_reason, dict(last.delta.model_extra or {})


def responses_final(events: list) -> tuple[str, dict]:
    """A Responses stream's last event type and the extra fields of its last output item."""
    final = events[-1]
    return final.type, dict(final.response.output[-1].model_extra or {})


def messages_final(events: list) -> tuple[str, dict]:
    """A Messages stream's stop reason and the extra fields of its ``message_delta`` event."""
    delta = next(e for e in reversed(events) if e.type == "message_delta")
    return delta.delta.stop_reason, dict(delta.model_extra or {})


def answers_on_every_api(srv) -> dict[str, dict]:
    """The extra fields of one answer on each API, where the local backend puts the version: the
    chat message / the finish chunk's delta, the last Responses item, the Message / its
    ``message_delta``, the completions choice / its finish chunk."""
    oa, an = _openai(srv), _anthropic(srv)
    chat = dict(oa.chat.completions.create(model="policy", messages=MSG).choices[0].message.model_extra or {})
    completion = oa.completions.create(model="policy", prompt="Hi").choices[0]
    completion_chunk = [
        c for c in oa.completions.create(model="policy", prompt="Hi", stream=True) if c.choices[0].finish_reason
    ][-1]
    return {
        "chat": chat,
        "chat stream": chat_final(list(oa.chat.completions.create(model="policy", messages=MSG, stream=True)))[1],
        "responses": dict(oa.responses.create(model="policy", input="Hi").output[-1].model_extra or {}),
        "responses stream": responses_final(list(oa.responses.create(model="policy", input="Hi", stream=True)))[1],
        "messages": dict(an.messages.create(model="policy", max_tokens=16, messages=MSG).model_extra or {}),
        "messages stream": messages_final(
            list(an.messages.create(model="policy", max_tokens=16, messages=MSG, stream=True))
        )[1],
        "completions": dict(completion.model_extra or {}),
        "completions stream": dict(completion_chunk.choices[0].model_extra or {}),
    }


def versions(answers: dict[str, dict]) -> dict[str, Any]:
    """``weight_version`` per API (``"absent"`` where an answer lacks the field)."""
    return {api: fields.get("weight_version", "absent") for api, fields in answers.items()}


# ------------------------------------------------------------------------------ vLLM: the gateway stamps
def test_vllm_answers_carry_the_version_forwarded_last_on_every_api(gateway, tmp_path):
    up = FakeVLLM(tokens=3, delay=0.001)
    srv, fake = gateway(up, "vllm")
    root = _root(srv)
    # Nothing forwarded yet, and vLLM names no version before its first finish_weight_update: null,
    # present on every API, and the servers' version is read once rather than on every call.
    assert versions(answers_on_every_api(srv)) == dict.fromkeys(APIS, None)
    reads = sum(1 for r in fake.requests if r.path == "/weight_info")
    assert 1 <= reads < len(APIS)

    r = httpx.post(
        root + "/update_weights", json={"update_info": {"path": _checkpoint(tmp_path)}, "weight_version": "step-1"}
    )
    assert r.status_code == 200, r.text
    assert versions(answers_on_every_api(srv)) == dict.fromkeys(APIS, "step-1")
    assert "weight_version_spans" not in answers_on_every_api(srv)["chat"]  # the gateway knows no spans

    # Renamed on the server behind the gateway's back: /health reads it, and answers follow.
    up.weight_version = "step-1b"
    assert httpx.get(root + "/health").json()["weight_version"] == "step-1b"
    msg = _openai(srv).chat.completions.create(model="policy", messages=MSG).choices[0].message
    assert msg.model_extra["weight_version"] == "step-1b"


def _streamed(client: openai.OpenAI) -> tuple[str, dict]:
    return chat_final(list(client.chat.completions.create(model="policy", messages=MSG, stream=True)))


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_an_update_forwarded_mid_generation_never_gives_a_wrong_version(gateway, tmp_path, caplog, mode):
    """keep: the calls in flight continue across the update, so they get null (logged, counted);
    abort and wait: they end before the update and carry the old version; held calls the new one."""
    up = FakeVLLM(tokens=40, delay=0.02)
    srv, fake = gateway(up, "vllm")
    root, client = _root(srv), _openai(srv)
    assert httpx.post(root + "/update_weight_version", json={"new_version": "v1"}).status_code == 200
    path = _checkpoint(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(4) as pool, caplog.at_level(logging.INFO, "gymserve.backends"):
        whole = pool.submit(client.chat.completions.create, model="policy", messages=MSG)
        streamed = pool.submit(_streamed, client)
        _wait(lambda: up.in_flight == 2, "two calls in flight")
        time.sleep(0.1)
        assert httpx.post(root + "/pause", params={"mode": mode}, timeout=WAIT).status_code == 200
        if mode != "keep":  # they end before the update: aborted by the server, or finished (wait)
            _wait(lambda: whole.done() and streamed.done(), "the calls in flight to end")
        held = pool.submit(client.chat.completions.create, model="policy", messages=MSG)
        _wait(lambda: srv.backend.gate.waiting == 1, "the call held at the gateway")
        update = {"update_info": {"path": path}, "weight_version": "v2"}
        assert httpx.post(root + "/update_weights", json=update).status_code == 200
        assert httpx.post(root + "/resume").status_code == 200
        answer, (finish, delta), late = whole.result(WAIT), streamed.result(WAIT), held.result(WAIT)
    expected = {"keep": ("stop", None), "abort": ("abort", "v1"), "wait": ("stop", "v1")}[mode]
    assert (answer.choices[0].finish_reason, answer.choices[0].message.model_extra["weight_version"]) == expected
    assert (finish, delta["weight_version"]) == expected
    assert late.choices[0].finish_reason == "stop" and late.choices[0].message.model_extra["weight_version"] == "v2"
    overlaps = re.search(r'gymserve_version_overlaps_total\{backend="chat",replica="[^"]+"\} (\S+)', _metrics(root))
    assert overlaps is not None and float(overlaps.group(1)) == (2 if mode == "keep" else 0)
    said = "overlapped a weight change forwarded to the servers; it carries weight_version null"
    assert caplog.text.count(said) == (2 if mode == "keep" else 0)


def _metrics(root: str) -> str:
    return httpx.get(root + "/metrics").text


def test_each_replica_answers_with_its_own_version_and_health_shows_them(gateway, servers):
    one, two = FakeVLLM(tokens=1, delay=0.001), FakeVLLM(tokens=2, delay=0.001)
    one.weight_version, two.weight_version = "a", "b"  # set on the servers, not through the gateway
    urls = [servers(one).url + "/v1", servers(two).url + "/v1"]
    srv, _ = gateway(urls[0], "vllm", base_urls=urls, routing={"policy": "round-robin"})
    client = _openai(srv)
    seen = {}
    for _ in range(4):
        msg = client.chat.completions.create(model="policy", messages=MSG).choices[0].message
        seen[msg.content] = msg.model_extra["weight_version"]  # one word from "a", two from "b"
    assert seen == {"w0 ": "a", "w0 w1 ": "b"}
    health = httpx.get(_root(srv) + "/health").json()
    assert [r["weight_version"] for r in health["replicas_control"]] == ["a", "b"]
    metrics = _metrics(_root(srv))
    for url, version in zip(urls, "ab"):
        assert f'gymserve_weight_version_info{{backend="chat",replica="{url[:-3]}",version="{version}"}} 1.0' in metrics


# ------------------------------------------------------------------------------ SGLang: its own field
def test_sglang_whole_answers_name_their_version_and_its_streams_get_the_gateways(gateway):
    up = FakeSGLang(tokens=3, delay=0.001)
    srv, fake = gateway(up, "none")  # the gateway knows nothing: what it passes on is SGLang's own
    got = versions(answers_on_every_api(srv))
    # SGLang's whole ChatCompletion / Completion carry metadata.weight_version; its streams nothing.
    assert got["chat"] == got["completions"] == got["responses"] == got["messages"] == "default"
    assert got["chat stream"] is got["completions stream"] is got["responses stream"] is got["messages stream"] is None
    up.weight_version = "s7"  # return_meta_info: the generation's meta_info on the choice
    msg = (
        _openai(srv)
        .chat.completions.create(model="policy", messages=MSG, extra_body={"return_meta_info": True})
        .choices[0]
        .message
    )
    assert msg.model_extra["weight_version"] == "s7"

    srv, fake = gateway(up, "sglang")  # the gateway reads /model_info for the streams
    assert set(versions(answers_on_every_api(srv)).values()) == {"s7"}
    assert [r.path for r in fake.requests].count("/model_info") == 1


# ------------------------------------------------------------------------------ a gymserve behind it
@pytest.fixture(scope="module")
def upstream(tiny_model_dir, tokenizer):
    srv = serve_tiny(tiny_model_dir, tokenizer, seed=99)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def original(tiny_model_dir):
    return weights_of(tiny_model_dir)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture
def fresh(upstream, original):
    """The upstream unpaused on the tiny model's own weights after the test."""
    yield
    upstream.resume_generation()
    upstream.update_weights(original)


class Reader(threading.Thread):
    """One streamed call read in a thread: ``items`` as they come."""

    def __init__(self, start: Callable[[], Iterable[Any]]):
        super().__init__(daemon=True)
        self.start_call, self.items, self.error = start, [], None
        self.start()

    def run(self) -> None:
        try:
            for item in self.start_call():
                self.items.append(item)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc

    def text_deltas(self) -> int:
        kinds = ("response.output_text.delta", "content_block_delta")
        return sum(
            1
            for x in list(self.items)
            if getattr(x, "type", None) in kinds or (getattr(x, "choices", None) and x.choices[0].delta.content)
        )

    def result(self) -> list:
        self.join(WAIT)
        assert not self.is_alive() and self.error is None, self.error
        return self.items


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_a_gymserve_behind_the_gateway_names_its_versions_and_spans(
    gateway, upstream, original, ref, fresh, tmp_path, mode
):
    srv, _ = gateway(upstream.base_url, "vllm")  # gymserve answers vLLM's control routes
    root, oa, an = _root(srv), _openai(srv), _anthropic(srv)
    v0, new = upstream.weight_version, f"{mode}-1"
    step = noisy(original, seed=11)
    save_file(step, str(tmp_path / "model.safetensors"))
    n = 3000 if mode == "abort" else 40
    streams = [
        Reader(lambda: oa.chat.completions.create(model="policy", messages=MSG, max_tokens=n, stream=True)),
        Reader(lambda: oa.responses.create(model="policy", input="Hi", max_output_tokens=n, stream=True)),
        Reader(lambda: an.messages.create(model="policy", max_tokens=n, messages=MSG, stream=True)),
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(oa.chat.completions.create, model="policy", messages=MSG, max_tokens=n)
        _wait(lambda: all(s.text_deltas() >= 3 for s in streams), "three tokens on each stream")
        assert httpx.post(root + "/pause", params={"mode": mode}, timeout=WAIT).status_code == 200
        if mode != "keep":
            _wait(lambda: whole.done() and not any(s.is_alive() for s in streams), "the calls in flight to end")
        r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}, "weight_version": new})
        assert r.status_code == 200 and r.json()["weight_version"] == new, r.text
        assert upstream.weight_version == new  # start / update / finish_weight_update, as vLLM's are sent
        assert httpx.post(root + "/resume").status_code == 200
        finals = [chat_final(streams[0].result()), responses_final(streams[1].result())]
        finals += [
            messages_final(streams[2].result()),
            ("whole", dict(whole.result(WAIT).choices[0].message.model_extra)),
        ]
    states = {v0: original, new: {**original, **step}}
    for (_, f), name in zip(finals, ("chat", "responses", "messages", "whole")):
        assert f["weight_version"] == v0, name
        spans = [s["version"] for s in f.get("weight_version_spans", [])]
        assert spans == ([v0, new] if mode == "keep" else []), name  # keep: the rest on the new weights
        check_teacher_forced(ref, states, f)
    if mode == "abort":
        assert [reason for reason, _ in finals[:3]] == ["abort", "response.incomplete", "pause_turn"]
    after = oa.chat.completions.create(model="policy", messages=MSG, max_tokens=8).choices[0].message.model_extra
    assert after["weight_version"] == new and "weight_version_spans" not in after
    check_teacher_forced(ref, states, after)
    completion = oa.completions.create(model="policy", prompt="Hi", max_tokens=4).choices[0].model_extra
    assert completion["weight_version"] == new  # the upstream's, on the choice itself
    check_teacher_forced(ref, states, completion)
