"""The ray backend's control plane on a real local Ray instance: 2 CPU replicas of the tiny model
behind the real server (``ray_cluster.control``).

Weight updates reach every replica from a directory, from in-process tensors and from an object the
driver put in Ray's object store; an update one replica refuses is undone on the other; a call that
started on one version is never retried on another after its replica dies; a replica Ray restarts
with the original weights is brought up to the fleet's version before it takes calls again. One Ray
instance serves the module (start-up ~30 s on 2 cores); the tests run in file order; every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

ray = pytest.importorskip("ray", reason="the ray backend needs Ray: pip install 'gymserve[ray]'")

from gymserve.config import GymserveConfig, RayBackendConfig, ServerConfig  # noqa: E402
from gymserve.harness.verify import load_model, teacher_forced_log_probs  # noqa: E402
from gymserve.server.run import start_background_server  # noqa: E402

WAIT = 120
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    if ray.is_initialized():  # pragma: no cover - another test left Ray connected
        pytest.skip("Ray is already initialised in this process")
    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=RayBackendConfig.model_validate(
            {
                "type": "ray",
                "model": str(tiny_model_dir),
                "replicas": 2,
                "ray_address": "local",
                "replica_resources": {"num_cpus": 1},
                "health_check_interval": 0.5,
                "health_check_timeout": 10,
                "startup_timeout": WAIT,
                "object_store_memory": 300 * 1024 * 1024,
                "max_model_len": 2048,
                "pause_timeout": 60,
                "tool_call_parser": "none",
            }
        ),
    )
    srv = start_background_server(cfg, startup_timeout=WAIT + 30)
    yield srv
    srv.stop(timeout=60)
    if ray.is_initialized():  # pragma: no cover
        ray.shutdown()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.base_url.removesuffix("/v1"), timeout=WAIT) as client:
        yield client


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return {k: v.clone() for k, v in load_model(tiny_model_dir).state_dict().items()}


def _on_loop(cluster, coro):
    return asyncio.run_coroutine_threadsafe(coro, cluster.loop).result(WAIT)


def _replica(cluster, name):
    return next(r for r in cluster.backend.replicas if r.name == name)


def _remote(ref):
    return ray.get(ref, timeout=WAIT)


def _served_state(cluster, name) -> dict[str, torch.Tensor]:
    return _remote(_replica(cluster, name).client.export_weights.remote())["tensors"]


def _chat(http, session, max_tokens=6, **extra):
    r = http.post(
        "/v1/chat/completions",
        headers={"X-Session-ID": session},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Hi {session}"}],
            "max_tokens": max_tokens,
            **extra,
        },
    )
    return r


def _wait(predicate, what: str, timeout: float = WAIT, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _versions(http) -> dict[str, object]:
    return {row["replica"]: row["weight_version"] for row in http.get("/health").json()["replicas_control"]}


def _check_answer(http, model, session, version):
    """An answer from ``version`` whose log-probs match teacher forcing on ``model``."""
    r = _chat(http, session)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["weight_version"] == version
    got = teacher_forced_log_probs(model, msg["prompt_token_ids"], msg["generation_token_ids"])
    assert max(abs(a - b) for a, b in zip(got, msg["generation_log_probs"])) < 1e-3


def test_updates_reach_every_replica_from_disk_tensors_and_the_object_store(
    http, cluster, base, tiny_model_dir, tmp_path
):
    teacher = load_model(tiny_model_dir)
    assert set(_versions(http).values()) == {0}
    sessions = [f"upd-{i}" for i in range(4)]  # spread over both replicas (round-robin)

    # From a directory (vLLM's disk transfer shape).
    new = base[NORM] * 1.5
    save_file({NORM: new}, str(tmp_path / "model.safetensors"))
    r = http.post("/update_weights", json={"update_info": {"path": str(tmp_path)}, "weight_version": "disk-1"})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "disk-1"
    assert _versions(http) == {"replica-0": "disk-1", "replica-1": "disk-1"}
    teacher.load_state_dict({**base, NORM: new})
    for s in sessions:
        _check_answer(http, teacher, s, "disk-1")
    metrics = http.get("/metrics").text
    for name in ("replica-0", "replica-1"):
        assert f'gymserve_weight_version_info{{backend="ray",replica="{name}",version="disk-1"}} 1.0' in metrics
    rows = {row["name"]: row for row in http.get("/health").json()["replicas"]}
    assert rows["replica-0"]["weight_version"] == rows["replica-1"]["weight_version"] == "disk-1"

    # From in-process tensors (put once into the object store by the front end).
    new = base[NORM] * 0.5
    assert (
        _on_loop(cluster, cluster.backend.control.update_weights({NORM: new}, weight_version="tensors-2"))
        == "tensors-2"
    )
    teacher.load_state_dict({**base, NORM: new})
    for s in sessions:
        _check_answer(http, teacher, s, "tensors-2")

    # From an object the driver put in Ray's object store, handed to every replica by reference.
    new = base[NORM] * 2.0
    ref = ray.put({NORM: new})
    assert _on_loop(cluster, cluster.backend.control.update_weights(ref)) == 3  # the fleet's count of changes
    for name in ("replica-0", "replica-1"):
        assert torch.equal(_served_state(cluster, name)[NORM], new)
    assert _versions(http) == {"replica-0": 3, "replica-1": 3}
    teacher.load_state_dict({**base, NORM: new})
    _check_answer(http, teacher, "upd-0", 3)


def _linear_shape(state, module) -> tuple[int, int]:
    out_f, in_f = state[f"{module}.weight"].shape
    return out_f, in_f


def test_an_update_one_replica_refuses_is_undone_on_the_other(http, cluster, base):
    from peft import LoraConfig

    version = _versions(http)["replica-0"]
    r0 = _replica(cluster, "replica-0")
    before = {name: _served_state(cluster, name) for name in ("replica-0", "replica-1")}
    # A LoRA merged on replica-0 only (behind the front end's back, under the same version), so
    # that a full update succeeds on replica-1 and is refused (409) on replica-0.
    q = "model.layers.0.self_attn.q_proj"
    layer = _linear_shape(base, q)
    tensors = {
        f"base_model.model.{q}.lora_A.weight": torch.ones(2, layer[1]) * 0.01,
        f"base_model.model.{q}.lora_B.weight": torch.ones(layer[0], 2) * 0.01,
    }
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    got = _remote(
        r0.client.apply.remote(
            "rogue", "load_lora_adapter", tensors, {"lora_name": "rogue", "config": cfg, "weight_version": version}
        )
    )
    assert got == {"weight_version": version}
    _remote(r0.client.commit.remote("rogue"))
    rogue = _served_state(cluster, "replica-0")

    r = http.post("/update_weight_version", json={"new_version": "renamed"})
    assert r.status_code == 200  # a rename touches no tensor: both replicas take it
    assert _versions(http) == {"replica-0": "renamed", "replica-1": "renamed"}
    version = "renamed"
    tmp = {NORM: base[NORM] * 3}
    with pytest.raises(Exception) as exc:
        _on_loop(cluster, cluster.backend.control.update_weights(tmp, weight_version="refused"))
    err = exc.value
    assert getattr(err, "status_code", None) == 409 and err.code == "lora_adapter_merged"
    assert err.message.startswith("replica-0: ") and "undone on replica-1" in err.message
    versions = _versions(http)
    assert versions["replica-0"] == versions["replica-1"] != "refused"
    after1 = _served_state(cluster, "replica-1")
    assert all(torch.equal(after1[k], before["replica-1"][k]) for k in after1), (
        "replica-1 was not rolled back bit for bit"
    )
    after0 = _served_state(cluster, "replica-0")
    assert all(torch.equal(after0[k], rogue[k]) for k in after0)
    # Over HTTP the same refusal is a 409 naming the replica, and the answers keep one version.
    r = http.post("/update_weights", json={"update_info": {"path": "/nonexistent/dir"}})
    assert r.status_code == 409 and r.json()["error"]["message"].startswith("replica-0: ")
    fleet = versions["replica-0"]
    # Clean up behind the front end again: replica-0 unloads its rogue adapter.
    _remote(
        r0.client.apply.remote("clean", "unload_lora_adapter", None, {"lora_name": "rogue", "weight_version": fleet})
    )
    _remote(r0.client.commit.remote("clean"))
    # A path no replica can read: refused by both, nothing changed, the 400 names the path.
    r = http.post("/update_weights", json={"update_info": {"path": "/nonexistent/dir"}})
    assert r.status_code == 400 and "/nonexistent/dir" in r.json()["error"]["message"], r.text
    assert "nothing changed" in r.json()["error"]["message"]
    assert _versions(http) == {"replica-0": fleet, "replica-1": fleet}
    for i in range(4):
        r = _chat(http, f"after-refusal-{i}")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["weight_version"] == fleet


def test_failover_never_lands_on_another_version_and_a_restarted_replica_catches_up(http, cluster, base):
    """A long call starts on version V on its replica; the fleet moves to V+1 (keep pause: the call
    freezes and continues); its replica is killed: the retry finds no replica on V and the call
    fails 502 version_unavailable instead of being answered by V+1. Ray restarts the replica with the
    original weights; the front end copies the fleet's state into it and routes to it again."""
    start_version = _versions(http)["replica-0"]
    session = "long-call"
    r = _chat(http, session, max_tokens=2)
    assert r.status_code == 200
    owner = next(n for n, calls in _served_sessions(cluster).items() if session in calls)
    victim = _replica(cluster, owner)
    other = next(r for r in cluster.backend.replicas if r is not victim)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_chat, http, session, 1500)
        _wait(
            lambda: _remote(victim.client.info.remote())["in_flight"] == 1, "the long call to be in flight", every=0.02
        )
        new = base[NORM] * 1.1
        assert (
            _on_loop(cluster, cluster.backend.control.update_weights({NORM: new}, weight_version="moved-on"))
            == "moved-on"
        )
        ray.kill(victim.client, no_restart=False)
        r = fut.result(timeout=WAIT)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "version_unavailable"
    assert repr(start_version) in error["message"] and "'moved-on'" in error["message"]
    # The other replica never saw the retried call.
    assert _served_sessions(cluster)[other.name].get(session) is None

    def caught_up():
        rows = {row["replica"]: row for row in http.get("/health").json()["replicas_control"]}
        row = rows[victim.name]
        return row if row["weight_version"] == "moved-on" and row["routable"] else None

    _wait(caught_up, "Ray to restart the replica and the front end to bring it up to date")
    assert torch.equal(_served_state(cluster, victim.name)[NORM], new)
    # It takes calls again, on the fleet's version.
    answered = set()
    for i in range(6):
        r = _chat(http, f"after-restart-{i}")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["weight_version"] == "moved-on"
    for name, calls in _served_sessions(cluster).items():
        if any(s.startswith("after-restart-") for s in calls):
            answered.add(name)
    assert answered == {"replica-0", "replica-1"}


def _served_sessions(cluster) -> dict[str, dict[str, int]]:
    out = {}
    for r in cluster.backend.replicas:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                out[r.name] = _remote(r.client.served_sessions.remote())
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return out


def test_pause_modes_reach_every_replica(http, cluster):
    r = http.post("/pause", params={"mode": "keep", "timeout": 30})
    assert r.status_code == 200
    assert http.get("/is_paused").json()["is_paused"] is True
    statuses = [_remote(rep.client.control_status.remote()) for rep in cluster.backend.replicas]
    assert [s["paused"] for s in statuses] == ["keep", "keep"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(_chat, http, "held-while-paused")
        time.sleep(1.0)
        assert not held.done()  # held at the front end, never dropped
        assert http.post("/resume").status_code == 200
        r = held.result(timeout=WAIT)
    assert r.status_code == 200
    statuses = [_remote(rep.client.control_status.remote()) for rep in cluster.backend.replicas]
    assert [s["paused"] for s in statuses] == [None, None]
