"""The ray backend: 2 CPU replicas of the tiny model on a local Ray instance behind the real server,
on each in-process CPU engine (``local_engine``).

One Ray instance and one front end serve the whole module (start-up costs ~30 s on 2 cores); the
tests run in file order and the last one shuts everything down and checks no Ray process is left.
Every wait is bounded.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray backend needs Ray: pip install 'gymserve[ray]'")

from gymserve.config import GymserveConfig, RayBackendConfig, ServerConfig, load_config  # noqa: E402
from gymserve.ray_cluster.cli import add_launch_parser, add_status_parser, launch_overrides, main_status  # noqa: E402
from gymserve.server.run import start_background_server  # noqa: E402

WAIT = 120  # seconds: the bound on any single wait in this file


@pytest.fixture(scope="module")
def cluster(local_engine):
    engine, model = local_engine
    if ray.is_initialized():  # pragma: no cover - another test left Ray connected
        pytest.skip("Ray is already initialised in this process")
    cfg = GymserveConfig(
        server=ServerConfig(port=0),
        backend=RayBackendConfig.model_validate(
            {
                "type": "ray",
                "model": str(model),
                "engine": engine,
                "replicas": 2,
                "ray_address": "local",
                "replica_resources": {"num_cpus": 1},
                "health_check_interval": 0.5,
                "health_check_timeout": 10,
                "startup_timeout": WAIT,
                "object_store_memory": 80 * 1024 * 1024,
                "max_model_len": 512,
            }
        ),
    )
    srv = start_background_server(cfg, startup_timeout=WAIT + 30)
    yield srv
    srv.stop(timeout=60)
    if ray.is_initialized():  # pragma: no cover - only when the server thread died without closing
        ray.shutdown()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.base_url.removesuffix("/v1"), timeout=WAIT) as client:
        yield client


def _chat(http, messages, session, max_tokens=4) -> dict:
    r = http.post(
        "/v1/chat/completions",
        headers={"X-Session-ID": session},
        json={"model": "tiny", "messages": messages, "max_tokens": max_tokens},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _next_turn(messages, msg, text) -> list[dict]:
    """The conversation with the assistant message sent back with its token fields, as NeMo Gym does."""
    keep = {k: msg[k] for k in ("content", "prompt_token_ids", "generation_token_ids", "generation_log_probs")}
    return messages + [{"role": "assistant", **keep}, {"role": "user", "content": text}]


def _served(cluster) -> dict[str, dict[str, int]]:
    """``{replica: {session: calls}}`` as each replica process itself counts them."""
    out: dict[str, dict[str, int]] = {}
    for r in cluster.backend.replicas:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                out[r.name] = ray.get(r.client.served_sessions.remote(), timeout=WAIT)
                break
            except ray.exceptions.ActorUnavailableError:
                # A replica that was just killed is restarting: ask again once Ray has it back.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return out


def _health(http) -> dict:
    return http.get("/health").json()


def _wait(predicate, what: str, timeout: float = WAIT, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_health_lists_replicas(http, capsys):
    h = _health(http)
    assert h["status"] == "ok" and h["backend"] == "ray"
    rows = h["replicas"]
    assert [r["name"] for r in rows] == ["replica-0", "replica-1"]
    for r in rows:
        assert {"name", "state", "in_flight", "sessions", "node", "restarts"} <= set(r)
        assert r["state"] == "alive" and r["restarts"] == 0 and r["node"] == "127.0.0.1"
    assert rows[0]["pid"] != rows[1]["pid"]  # two processes, not two names for one
    assert main_status(str(http.base_url) + "/v1") == 0
    table = capsys.readouterr().out
    assert "replica-0" in table and "replica-1" in table and "RESTARTS" in table


def test_sessions_spread_across_replicas_and_stick(http, cluster):
    sessions = [f"spread-{i}" for i in range(6)]

    def rollout(session):
        messages = [{"role": "user", "content": f"Hello from {session}"}]
        for turn in range(3):
            msg = _chat(http, messages, session)
            messages = _next_turn(messages, msg, f"turn {turn + 2}")

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(rollout, sessions, timeout=WAIT))
    served = _served(cluster)
    for s in sessions:
        owners = {name: calls[s] for name, calls in served.items() if s in calls}
        assert list(owners.values()) == [3], f"{s} was served by {owners}; all 3 turns must land on one replica"
    per_replica = {name: sum(s in calls for s in sessions) for name, calls in served.items()}
    assert all(n >= 1 for n in per_replica.values()), per_replica
    assert sum(r["sessions"] for r in _health(http)["replicas"]) >= len(sessions)


def test_killed_replica_sessions_continue_on_the_other_with_exact_tokens(http, cluster, local_engine):
    """Kill a replica's actor while its sessions' calls are in flight: those calls are retried on the
    other replica (re-prefilled from the token fields), their token fields are exact, the sessions
    stay there, and Ray restarts the dead replica."""
    from gymserve.harness.verify import load_model, teacher_forced_log_probs

    sessions = [f"kill-{i}" for i in range(4)]
    convs = {s: [{"role": "user", "content": f"Start {s}"}] for s in sessions}
    first = {}
    for s in sessions:
        first[s] = _chat(http, convs[s], s)
        convs[s] = _next_turn(convs[s], first[s], "Go on, at length.")
    served = _served(cluster)
    victim_name = "replica-0"
    victim = next(r for r in cluster.backend.replicas if r.name == victim_name)
    survivor = next(r for r in cluster.backend.replicas if r.name != victim_name)
    doomed = [s for s in sessions if s in served[victim_name]]
    assert doomed and len(doomed) < len(sessions), served

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        # Long generations for the victim's sessions, so they are surely in flight when it dies.
        futures = {s: pool.submit(_chat, http, convs[s], s, 400 if s in doomed else 4) for s in sessions}
        _wait(
            lambda: ray.get(victim.client.info.remote(), timeout=WAIT)["in_flight"] == len(doomed),
            "the victim's calls to be in flight",
            every=0.02,
        )
        old_pid = victim.pid
        ray.kill(victim.client, no_restart=False)  # a crash: Ray restarts the actor (max_restarts=-1)
        second = {s: f.result(timeout=WAIT) for s, f in futures.items()}

    model = load_model(str(local_engine[1]), local_engine[0])
    for s in sessions:
        p1, g1 = first[s]["prompt_token_ids"], first[s]["generation_token_ids"]
        p2, g2, lp2 = (second[s][k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"))
        assert p2[: len(p1) + len(g1)] == p1 + g1, f"{s}: turn 2 prompt does not extend turn 1"
        assert len(g2) == len(lp2) > 0
        recomputed = teacher_forced_log_probs(model, p2, g2)
        assert max(abs(a - b) for a, b in zip(recomputed, lp2)) < 1e-3, s
    assert all(len(second[s]["generation_token_ids"]) == 400 for s in doomed)

    served = _served(cluster)
    for s in doomed:
        assert served[survivor.name].get(s) == 1, f"{s} did not continue on {survivor.name}: {served}"

    def restarted():
        row = next(r for r in _health(http)["replicas"] if r["name"] == victim_name)
        return row if row["state"] == "alive" and row["restarts"] == 1 else None

    row = _wait(restarted, "Ray to restart the killed replica")
    assert row["pid"] != old_pid
    # The moved sessions stay on the survivor; the restarted replica never saw them.
    for s in doomed:
        convs[s] = _next_turn(convs[s], second[s], "And then?")
        _chat(http, convs[s], s)
    served = _served(cluster)
    for s in doomed:
        assert served[survivor.name][s] == 2 and s not in served[victim_name]
    # The restarted replica takes new sessions again.
    for i in range(4):
        _chat(http, [{"role": "user", "content": "new"}], f"after-restart-{i}")
    assert any(k.startswith("after-restart-") for k in _served(cluster)[victim_name])


def test_streaming_and_responses_go_through_replicas(http, cluster):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 5,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": "stream-1"}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    deltas = [json.loads(ln[6:])["choices"][0]["delta"] for ln in lines[:-1] if json.loads(ln[6:]).get("choices")]
    final = next(d for d in reversed(deltas) if "generation_token_ids" in d)
    assert len(final["generation_token_ids"]) == len(final["generation_log_probs"]) == 5

    r = http.post(
        "/v1/responses",
        headers={"X-Session-ID": "resp-1"},
        json={"model": "tiny", "input": "hello", "max_output_tokens": 4},
    )
    assert r.status_code == 200, r.text
    item = r.json()["output"][-1]
    assert len(item["generation_token_ids"]) == 4 and item["prompt_token_ids"]
    served = _served(cluster)
    assert sum("stream-1" in c for c in served.values()) == 1 and sum("resp-1" in c for c in served.values()) == 1

    # A request error inside a replica comes back exactly as the local backend gives it.
    r = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 600}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_completions_and_tokens_go_through_replicas(http, cluster, local_engine):
    """/v1/completions (whole and streamed, echo + logprobs), /tokenize and /detokenize are the
    replicas' local backends' answers, routed by session as chat is. The llamacpp engine computes
    no prompt log-probs: its replicas' 501 comes through as it is."""
    import openai

    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    scored = local_engine[0] == "transformers"  # prompt log-probs
    kwargs = dict(model="tiny", prompt=[9707, 11, 1879], max_tokens=3, echo=scored, logprobs=1)
    if not scored:
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(**{**kwargs, "echo": True})
        assert refused.value.status_code == 501 and "llamacpp engine does not compute prompt log-probs" in str(
            refused.value
        )
    head = {"X-Session-ID": "cmpl-1"}
    whole = client.completions.create(**kwargs, extra_headers=head).choices[0]
    gen = whole.model_extra["generation_token_ids"]
    assert whole.model_extra["prompt_token_ids"] == [9707, 11, 1879] and len(gen) == 3
    shown = 3 if scored else 0  # prompt tokens listed before the generated ones
    assert len(whole.logprobs.tokens) == shown + 3
    assert whole.logprobs.token_logprobs[shown:] == whole.model_extra["generation_log_probs"]
    chunks = list(client.completions.create(**kwargs, stream=True, extra_headers=head))
    [final] = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    if scored:
        assert whole.logprobs.token_logprobs[0] is None
        assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("Hello, world")
        # The prompt's scores do not depend on sampling: the streamed call's equal the whole one's.
        # (one prefill each, alone, on the same weights: the same numbers).
        assert final.logprobs.token_logprobs[:3] == whole.logprobs.token_logprobs[:3]
        assert final.model_extra["prompt_logprobs"] == whole.model_extra["prompt_logprobs"]
    else:
        assert final.model_extra["prompt_token_ids"] == [9707, 11, 1879]

    r = http.post("/tokenize", json={"prompt": "Hello world"}, headers={"X-Session-ID": "cmpl-1"})
    assert r.status_code == 200 and r.json()["tokens"] == [9707, 1879] and r.json()["max_model_len"] == 512
    r = http.post("/detokenize", json={"tokens": [9707, 1879]}, headers={"X-Session-ID": "cmpl-1"})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    r = http.post("/detokenize", json={"tokens": [151936]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"
    served = _served(cluster)
    assert [c.get("cmpl-1") for c in served.values() if "cmpl-1" in c] == [4]  # one replica served all four


def _ray_processes() -> dict[int, str]:
    """Descendant processes of this test process whose command line mentions ray."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = {}, [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "ray" in cmd or "raylet" in cmd or "gcs_server" in cmd:
                found[pid] = cmd[:120]
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has yet to reap it


def test_shutdown_leaves_no_ray_processes(http, cluster):
    replica_pids = [r["pid"] for r in _health(http)["replicas"]]
    before = _ray_processes()
    assert set(replica_pids) <= set(before), (replica_pids, before)
    assert any("raylet" in c for c in before.values()) and any("gcs_server" in c for c in before.values())
    cluster.stop(timeout=60)
    assert not ray.is_initialized()
    _wait(lambda: not any(_alive(pid) for pid in before), "Ray's processes to exit", timeout=60, every=0.5)
    assert not {p: c for p, c in _ray_processes().items() if _alive(p)}


def test_launch_flags_become_a_ray_config(tmp_path):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_launch_parser(sub)
    add_status_parser(sub)
    args = parser.parse_args(
        [
            "launch",
            "--model",
            str(tmp_path),
            "--replicas",
            "2",
            "--ray-address",
            "auto",
            "--num-cpus",
            "2",
            "--num-gpus",
            "1",
            "--placement-strategy",
            "SPREAD",
            "--port",
            "9000",
        ]
    )
    cfg = load_config(None, overrides=launch_overrides(args))
    b = cfg.backend
    assert isinstance(b, RayBackendConfig)
    assert (b.replicas, b.ray_address, b.placement_strategy) == (2, "auto", "SPREAD")
    assert (b.replica_resources.num_cpus, b.replica_resources.num_gpus) == (2.0, 1.0)
    assert b.local.model == str(tmp_path) and cfg.server.port == 9000
    # A local config file becomes a ray one with the same engine options.
    path = tmp_path / "c.yaml"
    path.write_text("backend:\n  type: local\n  model: embedded\n  max_model_len: 256\n  sampling: {seed: 3}\n")
    cfg = load_config(str(path), overrides=launch_overrides(parser.parse_args(["launch", "--config", str(path)])))
    assert cfg.backend.type == "ray" and cfg.backend.local.max_model_len == 256 and cfg.backend.local.sampling.seed == 3
    assert parser.parse_args(["status"]).base_url == "http://127.0.0.1:8000/v1"


def test_replica_errors_cross_the_wire_as_the_same_error():
    """A GymserveError returned by a replica is rebuilt on the front end with its class, status and fields."""
    from gymserve.errors import ContextLengthExceededError, GymserveError, OverloadedError, UpstreamError
    from gymserve.ray_cluster.replica import error_payload, raise_remote_error

    for original in (
        ContextLengthExceededError(900, 512),
        OverloadedError("busy", retry_after=3.0),
        UpstreamError("boom", status_code=504, code="x"),
    ):
        with pytest.raises(GymserveError) as exc:
            raise_remote_error(error_payload(original))
        got = exc.value
        assert type(got) is type(original) and got.to_dict() == original.to_dict()
        assert got.status_code == original.status_code
    assert raise_remote_error({"id": "chatcmpl-1"}) == {"id": "chatcmpl-1"}
    assert exc.value.status_code == 504
    with pytest.raises(OverloadedError) as over:
        raise_remote_error(error_payload(OverloadedError("busy", retry_after=3.0)))
    assert over.value.retry_after == 3.0
    with pytest.raises(ContextLengthExceededError) as ctx:
        raise_remote_error(error_payload(ContextLengthExceededError(900, 512)))
    assert (ctx.value.prompt_tokens, ctx.value.context_window) == (900, 512)
