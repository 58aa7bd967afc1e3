"""Serving a policy being trained, end to end: a real gymserve on 127.0.0.1 around the tiny model
(``serve_policy``), the official openai SDK as the client, weight updates and pauses arriving while
several streams are in flight, and every reported log-prob checked by teacher forcing on the
weights of the version that sampled it."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from gymserve.errors import WeightUpdateError
from gymserve.harness.verify import load_model
from gymserve.server.embed import serve_policy
from helpers.policy_weights import DOWN, check_teacher_forced, noisy, serve_tiny, weights_of


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def policy(tiny_model_dir, tokenizer):
    srv = serve_tiny(tiny_model_dir, tokenizer, seed=1234)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def original(tiny_model_dir):
    return weights_of(tiny_model_dir)


@pytest.fixture(autouse=True)
def fresh_weights(request, original):
    """Each test starts unpaused on the tiny model's own weights (its version number moves on)."""
    yield
    if "policy" in request.fixturenames:
        srv = request.getfixturevalue("policy")
        srv.resume_generation()
        srv.update_weights(original)


@pytest.fixture(scope="module")
def client(policy):
    return openai.OpenAI(base_url=policy.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def root(policy):
    return policy.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """The teacher: a separate copy of the model, loaded with each version's weights in turn."""
    return load_model(tiny_model_dir)


# ------------------------------------------------------------------------------------ helpers
def wait_until(predicate, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def fields(obj) -> dict:
    """gymserve's extra fields on an SDK object (message, delta or Responses item)."""
    return dict(obj.model_extra or {})


def answer(client, content: str = "Hello", max_tokens: int = 6) -> dict:
    """The training fields of one (seeded, so repeatable) chat answer."""
    msg = (
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens
        )
        .choices[0]
        .message
    )
    return fields(msg)


class Stream(threading.Thread):
    """One streamed call in a thread (chat, or Responses with ``api="responses"``), read as it comes."""

    def __init__(self, client, content: str, max_tokens: int, api: str = "chat"):
        super().__init__(daemon=True)
        self.client, self.content, self.max_tokens, self.api = client, content, max_tokens, api
        self.items: list = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            if self.api == "chat":
                stream = self.client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": self.content}],
                    max_tokens=self.max_tokens,
                    stream=True,
                )
            else:
                stream = self.client.responses.create(
                    model="tiny", input=self.content, max_output_tokens=self.max_tokens, stream=True
                )
            for item in stream:
                self.items.append(item)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc

    def seen(self) -> int:
        """Text deltas received so far (one per sampled token for this model and parser)."""
        if self.api == "chat":
            return sum(1 for c in self.items if c.choices and c.choices[0].delta.content)
        return sum(1 for e in self.items if e.type == "response.output_text.delta")

    def result(self) -> tuple[str, dict]:
        """``(finish, fields)``: chat: finish_reason and the final delta's training fields;
        Responses: the final event type with incomplete_details' reason, and the last item's fields."""
        self.join(120)
        assert not self.is_alive() and self.error is None, self.error
        if self.api == "chat":
            last = next(c.choices[0] for c in self.items if c.choices and c.choices[0].finish_reason)
            return last.finish_reason, fields(last.delta)
        final = self.items[-1]
        reason = final.response.incomplete_details.reason if final.response.incomplete_details else None
        item = final.response.output[-1]
        return f"{final.type}:{reason}", {**fields(item), "status": item.status}


# ------------------------------------------------------------------------------------ weight updates
def test_updates_from_a_directory_and_from_tensors_change_outputs_and_version(
    policy, client, root, original, ref, tmp_path, tiny_model_dir
):
    before = answer(client)
    v0 = before["weight_version"]
    assert v0 == policy.weight_version and "weight_version_spans" not in before

    subset = noisy(original, seed=1)
    (tmp_path / "step1").mkdir()
    save_file(subset, str(tmp_path / "step1" / "model.safetensors"))
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path / "step1")}})
    assert r.status_code == 200, r.text
    assert r.json()["message"] == "Weights updated" and r.json()["weight_version"] == v0 + 1
    after = answer(client)
    assert after["weight_version"] == v0 + 1 and after["generation_token_ids"] != before["generation_token_ids"]
    check_teacher_forced(ref, {v0 + 1: {**original, **subset}}, after)

    step2 = noisy(original, seed=2)
    assert policy.update_weights(step2, weight_version="step-2") == "step-2"
    chat = answer(client)
    assert chat["weight_version"] == "step-2" and chat["generation_token_ids"] != after["generation_token_ids"]
    check_teacher_forced(ref, {"step-2": {**original, **step2}}, chat)
    resp = client.responses.create(model="tiny", input="Hello", max_output_tokens=6)
    assert fields(resp.output[-1])["weight_version"] == "step-2"
    assert httpx.get(root + "/weight_info").json()["weight_version"] == "step-2"
    assert httpx.get(root + "/health").json()["weight_version"] == "step-2"
    metrics = httpx.get(root + "/metrics").text
    assert 'gymserve_weight_version_info{backend="local",replica="local",version="step-2"} 1.0' in metrics
    assert 'gymserve_generation_paused{backend="local",replica="local"} 0.0' in metrics

    # Full weights from the model's own directory (save_pretrained layout): the first answer again.
    r = httpx.post(root + "/update_weights", json={"update_info": {"path": str(tiny_model_dir)}, "weight_version": 7})
    assert r.status_code == 200 and r.json()["weight_version"] == 7
    again = answer(client)
    assert again["generation_token_ids"] == before["generation_token_ids"]
    assert again["generation_log_probs"] == before["generation_log_probs"] and again["weight_version"] == 7


def test_a_trainer_changing_the_model_itself_names_the_version(policy, client, original, ref):
    before = answer(client)
    served = policy.backend.engine.model  # the object serve_policy was given
    policy.pause_generation("keep")
    served.load_state_dict(noisy(original, seed=2), strict=False)  # in place, as an optimizer step would
    policy.update_weight_version("trainer-3")
    state = {k: v.clone() for k, v in served.state_dict().items()}
    policy.resume_generation()
    after = answer(client)
    assert after["weight_version"] == "trainer-3" and after["generation_token_ids"] != before["generation_token_ids"]
    check_teacher_forced(ref, {"trainer-3": state}, after)


def test_vllms_weight_update_session_names_the_new_weights(policy, client, root, original, ref, tmp_path):
    """vLLM's sequence (start_weight_update, update_weights, finish_weight_update with the version
    as a string), as a chat gateway with ``upstream_control: vllm`` sends it."""
    r = httpx.post(root + "/finish_weight_update", json={"weight_version": "x"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_weight_update_session"
    assert "POST /start_weight_update" in r.json()["error"]["message"]

    step = noisy(original, seed=5)
    save_file(step, str(tmp_path / "model.safetensors"))
    assert httpx.post(root + "/start_weight_update").json() == {"message": "Weight update started"}
    assert httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path)}}).status_code == 200
    r = httpx.post(root + "/finish_weight_update", json={"weight_version": "step-5"})
    assert r.json() == {"message": "Weight update finished", "weight_version": "step-5"}
    after = answer(client)
    assert after["weight_version"] == "step-5"
    check_teacher_forced(ref, {"step-5": {**original, **step}}, after)

    # A version that already names the weights (vLLM sends strings) renames nothing; none: neither.
    updates = httpx.get(root + "/weight_info").json()["weight_updates"]
    policy.update_weight_version(12)
    httpx.post(root + "/start_weight_update")
    r = httpx.post(root + "/finish_weight_update", json={"weight_version": "12"})
    assert r.json()["weight_version"] == 12
    httpx.post(root + "/start_weight_update")
    assert httpx.post(root + "/finish_weight_update").json()["weight_version"] == 12
    assert httpx.get(root + "/weight_info").json()["weight_updates"] == updates + 1


def _bad_sources(tmp_path, original) -> list[tuple[str, dict, str, str]]:
    """``(case, request body, param, words in the message)`` for every kind of bad update from disk."""
    cases = []

    def ckpt(name: str, tensors: dict | None = None, raw: bytes | None = None) -> str:
        d = tmp_path / name
        d.mkdir()
        if tensors is not None:
            save_file(tensors, str(d / "model.safetensors"))
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        return str(d)

    norm = original["model.norm.weight"]
    for case, tensors, param, words in (
        ("unknown", {"model.norm.weigth": norm}, "model.norm.weigth", "unknown name"),
        ("shape", {"model.norm.weight": norm[:10].clone()}, "model.norm.weight", "shape [10]"),
        ("dtype", {"model.norm.weight": norm.to(torch.float16)}, "model.norm.weight", "dtype torch.float16"),
        ("nan", {"model.norm.weight": torch.full_like(norm, float("nan"))}, "model.norm.weight", "NaN or infinite"),
        ("inf", {DOWN: torch.full_like(original[DOWN], float("inf"))}, DOWN, "NaN or infinite"),
    ):
        cases.append((case, {"update_info": {"path": ckpt(case, tensors)}}, param, words))
    corrupt = ckpt("corrupt", raw=b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    cases.append(("corrupt", {"update_info": {"path": corrupt}}, corrupt + "/model.safetensors", "cannot read"))
    empty = ckpt("empty")
    cases.append(("empty", {"update_info": {"path": empty}}, empty, "no .safetensors files"))
    missing = str(tmp_path / "missing")
    cases.append(("missing", {"update_info": {"path": missing}}, missing, "no such file or directory"))
    return cases


def test_bad_updates_are_refused_and_the_old_weights_keep_serving(policy, client, root, original, tmp_path):
    before = answer(client)
    version = before["weight_version"]
    for case, body, param, words in _bad_sources(tmp_path, original):
        r = httpx.post(root + "/update_weights", json=body)
        assert r.status_code == 400, (case, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_weights" and err["param"] == param and words in err["message"], (case, err)
        assert answer(client) == before, case  # same tokens, same log-probs, same version
    norm = original["model.norm.weight"]
    for tensors, words in (
        ({"nope": norm}, "unknown name"),
        ({"model.norm.weight": norm.double()}, "dtype"),
        ({"model.norm.weight": norm, DOWN: original[DOWN][:, :3]}, "shape"),
    ):
        with pytest.raises(WeightUpdateError, match=words):
            policy.update_weights(tensors)
        assert answer(client) == before
    assert policy.weight_version == version


# ------------------------------------------------------------------------------------ pause modes
def test_abort_ends_calls_in_flight_with_their_tokens_marked(policy, client, root, original, ref):
    streams = [
        Stream(client, "Tell me a story.", 3000),
        Stream(client, "Count to a million.", 3000),
        Stream(client, "Write an essay.", 3000, api="responses"),
    ]
    wait_until(lambda: all(s.seen() >= 3 for s in streams), what="three tokens on each stream")
    r = httpx.post(root + "/pause", params={"mode": "abort"})
    assert r.status_code == 200 and r.json()["status"] == "paused" and r.json()["mode"] == "abort"
    version = policy.weight_version
    for s in streams[:2]:
        finish, f = s.result()
        assert finish == "abort" and f["weight_version"] == version
        assert 3 <= len(f["generation_token_ids"]) < 3000
        assert len(f["generation_log_probs"]) == len(f["generation_token_ids"])
        check_teacher_forced(ref, {version: original}, f)
    finish, f = streams[2].result()
    assert finish == "response.incomplete:abort" and f["status"] == "incomplete" and len(f["generation_token_ids"]) >= 3
    check_teacher_forced(ref, {version: original}, f)

    # While paused, a new call waits (it is not refused), and runs after /resume.
    late = Stream(client, "Hello", 4)
    time.sleep(1.0)
    assert late.is_alive() and late.seen() == 0
    assert httpx.get(root + "/is_paused").json()["is_paused"] is True
    assert httpx.post(root + "/resume").json() == {"status": "resumed"}
    assert late.result()[0] == "length"
    assert httpx.get(root + "/is_paused").json() == {"is_paused": False, "mode": None, "seconds_left": None}


def test_wait_lets_calls_in_flight_finish_and_holds_new_ones_for_the_new_weights(
    policy, client, root, original, ref, tmp_path
):
    v0 = policy.weight_version
    streams = [Stream(client, f"Question {i}?", 24) for i in range(3)]
    wait_until(lambda: all(s.seen() >= 1 for s in streams), what="every stream to start")
    paused: list = []
    pauser = threading.Thread(
        target=lambda: paused.append(httpx.post(root + "/pause", params={"mode": "wait"}, timeout=300))
    )
    pauser.start()
    wait_until(lambda: httpx.get(root + "/is_paused").json()["is_paused"], what="the pause")
    assert any(s.seen() < 24 for s in streams)  # the pause came while they were generating
    new = [Stream(client, f"New question {i}?", 8) for i in range(3)]
    pauser.join(300)
    assert paused[0].status_code == 200, paused[0].text
    for s in streams:  # the pause took effect only once they had all finished
        finish, f = s.result()
        assert finish == "length" and len(f["generation_token_ids"]) == 24
        assert f["weight_version"] == v0 and "weight_version_spans" not in f
    assert all(s.is_alive() and s.seen() == 0 for s in new)

    step = noisy(original, seed=3)
    (tmp_path / "step").mkdir()
    save_file(step, str(tmp_path / "step" / "model.safetensors"))
    assert (
        httpx.post(root + "/update_weights", json={"update_info": {"path": str(tmp_path / "step")}}).status_code == 200
    )
    httpx.post(root + "/resume")
    for s in new:  # none dropped, none failed, all on the new weights
        finish, f = s.result()
        assert finish == "length" and f["weight_version"] == v0 + 1 and "weight_version_spans" not in f
        check_teacher_forced(ref, {v0 + 1: {**original, **step}}, f)


def test_keep_freezes_calls_and_they_continue_on_the_new_weights(policy, client, root, original, ref):
    v0 = policy.weight_version
    streams = [
        Stream(client, "Once upon a time", 40),
        Stream(client, "List some colors", 40),
        Stream(client, "Explain gravity", 40, api="responses"),
    ]
    wait_until(lambda: all(s.seen() >= 3 for s in streams), what="three tokens on each stream")
    assert httpx.post(root + "/pause", params={"mode": "keep"}).json()["mode"] == "keep"
    time.sleep(0.3)  # chunks already on the wire arrive
    frozen = [s.seen() for s in streams]
    time.sleep(1.0)
    assert [s.seen() for s in streams] == frozen and all(s.is_alive() for s in streams)

    step = noisy(original, seed=4)
    assert policy.update_weights(step) == v0 + 1
    httpx.post(root + "/resume")
    states = {v0: original, v0 + 1: {**original, **step}}
    for s in streams:
        finish, f = s.result()
        assert finish in ("length", "response.incomplete:max_output_tokens")
        spans = f["weight_version_spans"]
        assert [sp["version"] for sp in spans] == [v0, v0 + 1] and f["weight_version"] == v0
        assert spans[0]["start"] == 0 and 3 <= spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 40
        check_teacher_forced(ref, states, f)


def test_a_pause_resumes_by_itself_at_its_deadline(policy, client, root, caplog):
    stream = Stream(client, "Keep going", 30)
    wait_until(lambda: stream.seen() >= 2, what="two tokens")
    with caplog.at_level(logging.WARNING, logger="gymserve.engine"):
        r = httpx.post(root + "/pause", params={"mode": "keep", "timeout": 1})
        assert r.status_code == 200 and r.json()["timeout"] == 1
        state = httpx.get(root + "/is_paused").json()
        assert state["is_paused"] and state["mode"] == "keep" and 0 < state["seconds_left"] <= 1
        wait_until(lambda: not httpx.get(root + "/is_paused").json()["is_paused"], timeout=60, what="auto-resume")
        assert stream.result()[0] == "length"
    assert "reached its deadline of 1 s without resume_generation; resuming by itself" in caplog.text

    # A wait pause whose deadline comes before the calls in flight finish says so (409) and resumes.
    long = Stream(client, "Go on forever", 3000)
    wait_until(lambda: long.seen() >= 1, what="a token")
    r = httpx.post(root + "/pause", params={"mode": "wait", "timeout": 0.5}, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "pause_ended", r.text
    assert "its deadline of 0.5 s passed" in r.json()["error"]["message"]
    assert httpx.get(root + "/is_paused").json()["is_paused"] is False
    n = long.seen()
    wait_until(lambda: long.seen() > n, what="the call to go on")
    httpx.post(root + "/pause", params={"mode": "abort"})
    assert long.result()[0] == "abort"


# ------------------------------------------------------------------------------------ the HTTP surface
@pytest.mark.parametrize(
    "method, path, kwargs, param",
    [
        ("POST", "/pause", {"params": {"mode": "sleep"}}, "query.mode"),
        ("POST", "/pause", {"params": {"timeout": 0}}, "query.timeout"),
        ("POST", "/pause", {"params": {"timeout": "soon"}}, "query.timeout"),
        ("POST", "/update_weights", {"json": {}}, "update_info"),
        ("POST", "/update_weights", {"json": {"update_info": {"path": ""}}}, "update_info.path"),
        ("POST", "/update_weights", {"json": {"update_info": {"path": "/x"}, "weight_versoin": 1}}, "weight_versoin"),
        (
            "POST",
            "/update_weights",
            {"json": {"update_info": {"path": "/x"}, "weight_version": True}},
            "weight_version",
        ),
        ("POST", "/update_weights", {"content": b"{not json"}, None),
        ("POST", "/update_weight_version", {"json": {"new_version": ""}}, "new_version"),
        ("POST", "/update_weight_version", {"json": {"new_version": 1.5}}, "new_version"),
    ],
)
def test_bad_control_input_is_a_400_naming_the_field(policy, root, method, path, kwargs, param):
    r = httpx.request(method, root + path, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    assert httpx.get(root + "/is_paused").json()["is_paused"] is False


def test_control_routes_are_in_the_openapi_document(root):
    doc = httpx.get(root + "/openapi.json").json()
    for path, method in (
        ("/pause", "post"),
        ("/resume", "post"),
        ("/is_paused", "get"),
        ("/update_weights", "post"),
        ("/weight_info", "get"),
        ("/update_weight_version", "post"),
    ):
        assert method in doc["paths"][path], path
    mode = next(p for p in doc["paths"]["/pause"]["post"]["parameters"] if p["name"] == "mode")
    assert mode["schema"]["enum"] == ["abort", "wait", "keep"] and mode["schema"]["default"] == "abort"
    assert "409" in doc["paths"]["/pause"]["post"]["responses"]


def test_the_handle_stops_cleanly(tiny_model_dir, tokenizer):
    srv = serve_policy(str(tiny_model_dir), backend_config={"num_threads": 1})
    assert srv.base_url.startswith("http://127.0.0.1:") and srv.base_url.endswith("/v1")
    assert httpx.get(srv.base_url + "/models").json()["data"][0]["id"] == tiny_model_dir.name
    assert srv.weight_version == 0 and srv.is_paused() is False
    srv.stop()
    with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):
        httpx.get(srv.base_url + "/models")
    with pytest.raises(RuntimeError, match="stopped"):
        srv.update_weight_version(1)
