"""Process-group weight sync end to end: a real gymserve on 127.0.0.1 around the tiny model, and a
real trainer in a second process (``helpers/weight_trainer.py``: torch + ``gymserve.trainer`` only)
that joins a gloo group with it and broadcasts tensors. Answers and versions change when a transfer
completes; a wrong shape, or a trainer killed mid-transfer, leaves the old weights and version
serving with a clear error. Every wait is bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from gymserve.engine.weight_transfer import TensorMeta, bucket_layout, parse_metadata
from gymserve.errors import InvalidRequestError
from helpers.policy_weights import DOWN, NORM, check_teacher_forced, noisy, serve_tiny, weights_of

TRAINER = Path(__file__).resolve().parents[1] / "helpers" / "weight_trainer.py"
SRC = Path(__file__).resolve().parents[2] / "src"
WAIT = 180  # seconds any one trainer process may take


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tokenizer):
    srv = serve_tiny(tiny_model_dir, tokenizer, seed=4321)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def original(tiny_model_dir):
    return weights_of(tiny_model_dir)


@pytest.fixture(autouse=True)
def fresh_weights(request, original):
    yield
    if "policy" in request.fixturenames:
        srv = request.getfixturevalue("policy")
        srv.resume_generation()
        srv.update_weights(original)


@pytest.fixture(scope="module")
def client(policy):
    return openai.OpenAI(base_url=policy.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def root(policy):
    return policy.base_url.removesuffix("/v1")


def answer(client, content: str = "Hello") -> dict:
    msg = (
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=6)
        .choices[0]
        .message
    )
    return dict(msg.model_extra or {})


def run_trainer(root: str, state: dict[str, torch.Tensor], tmp_path: Path, **opts) -> tuple[int, list[dict]]:
    """Run the trainer process to its end (at most ``WAIT`` s); its exit status and JSON lines."""
    path = tmp_path / f"state-{len(list(tmp_path.iterdir()))}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    env = {**os.environ, "PYTHONPATH": str(SRC)}  # gymserve only: not the tests' helpers
    proc = subprocess.run(
        [sys.executable, str(TRAINER), root, str(path), json.dumps(opts)],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines or proc.returncode != 0, proc.stderr[-3000:]
    return proc.returncode, lines


def info(root: str) -> dict:
    return httpx.get(f"{root}/weight_info", timeout=30).json()


# ------------------------------------------------------------------------------ the transfer
@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20])
def test_a_trainer_process_updates_the_server_over_gloo(
    policy, client, root, original, tiny_model_dir, tmp_path, bucket_bytes
):
    """The whole state dict (noise on two tensors) from a trainer process: the answer changes, the
    version is the trainer's, each token's log-prob is teacher forcing's on the new weights; sent
    back, the original answer returns."""
    from gymserve.harness.verify import load_model

    before = answer(client)
    new = {**original, **noisy(original, seed=5)}
    rc, lines = run_trainer(root, new, tmp_path, weight_version="step-1", bucket_bytes=bucket_bytes)
    assert rc == 0
    (ans,) = lines[-1]["answers"]
    assert ans["weight_version"] == "step-1"
    assert ans["bytes"] == sum(t.numel() * t.element_size() for t in new.values())
    expected = len(new) if bucket_bytes == 0 else len(bucket_layout(list(_metas(new)), bucket_bytes))
    assert ans["broadcasts"] == expected and ans["broadcasts"] > 0
    after = answer(client)
    assert after["weight_version"] == "step-1"
    assert after["generation_token_ids"] != before["generation_token_ids"]
    ref = load_model(tiny_model_dir)
    check_teacher_forced(ref, {"step-1": new}, after)
    w = info(root)
    assert w["weight_version"] == "step-1"
    assert w["weight_transfer"]["transfers"] >= 1 and w["weight_transfer"]["last_error"] is None
    assert w["weight_transfer"]["group"] is None  # the trainer closed it

    rc, lines = run_trainer(root, original, tmp_path, weight_version="step-2", bucket_bytes=bucket_bytes)
    assert rc == 0 and lines[-1]["answers"][0]["weight_version"] == "step-2"
    again = answer(client)
    assert again["generation_token_ids"] == before["generation_token_ids"]


def _metas(state):
    return [TensorMeta(k, v.dtype, tuple(v.shape)) for k, v in state.items()]


def test_sglang_routes_carry_the_same_transfer(policy, client, root, original, tmp_path):
    """SGLang's init and update_weights_from_distributed bodies, abort_all_requests included."""
    before = answer(client)
    rc, lines = run_trainer(root, noisy(original, seed=7), tmp_path, api="sglang", weight_version=9, bucket_bytes=0)
    assert rc == 0
    out = lines[-1]
    assert out["open"]["success"] is True
    (ans,) = out["answers"]
    assert ans["success"] is True and ans["weight_version"] == 9 and ans["broadcasts"] == 2
    after = answer(client)
    assert after["weight_version"] == 9 and after["generation_token_ids"] != before["generation_token_ids"]


def test_a_wrong_shape_is_refused_after_the_broadcast_and_the_group_stays_usable(
    policy, client, root, original, tmp_path
):
    """A tensor of the wrong shape: the server receives what was announced (the trainer never
    hangs), refuses it naming the tensor, keeps the old weights and version; the same group then
    carries a good update."""
    before = answer(client)
    version = info(root)["weight_version"]
    bad = {NORM: original[NORM] + 1.0, DOWN: torch.zeros(3, 5)}
    rc, lines = run_trainer(root, bad, tmp_path, bucket_bytes=1 << 20, sends=1)
    assert rc == 0
    (err,) = lines[-1]["answers"]
    assert err["error"]["status"] == 400 and err["error"]["code"] == "invalid_weights"
    assert DOWN in err["error"]["message"] and "shape [3, 5]" in err["error"]["message"]
    assert info(root)["weight_version"] == version
    assert answer(client)["generation_token_ids"] == before["generation_token_ids"]
    assert "shape [3, 5]" in info(root)["weight_transfer"]["last_error"]


def test_a_trainer_killed_mid_transfer_leaves_the_old_weights_serving(policy, client, root, original, tmp_path):
    """The trainer dies after 2 of its 27 broadcasts (one per tensor): the server's receive fails at once, nothing is
    swapped, /weight_info and /health say what happened, and a new trainer can open a new group."""
    before = answer(client)
    version = info(root)["weight_version"]
    new = {**original, **noisy(original, seed=11)}
    rc, lines = run_trainer(root, new, tmp_path, bucket_bytes=0, die_after=2, timeout=30)
    assert rc == 17 and lines[-1] == {"dying_after": 2}
    w = info(root)
    assert w["weight_version"] == version
    err = w["weight_transfer"]["last_error"]
    assert (
        err.startswith(f"weight transfer failed after 2 of {len(new)} broadcasts") and "old weights keep serving" in err
    )
    assert w["weight_transfer"]["group"] is None and w["weight_transfer"]["in_progress"] is False
    health = httpx.get(f"{root}/health", timeout=30).json()
    assert health["weight_transfer"]["last_error"] == err and health["weight_version"] == version
    assert answer(client)["generation_token_ids"] == before["generation_token_ids"]

    rc, lines = run_trainer(root, new, tmp_path, weight_version="recovered")
    assert rc == 0 and lines[-1]["answers"][0]["weight_version"] == "recovered"
    assert answer(client)["generation_token_ids"] != before["generation_token_ids"]


def test_a_refusal_before_the_broadcast_drops_the_group_and_the_next_send_reopens_it(
    policy, client, root, original, tmp_path
):
    """The server refuses the body (an unknown pause mode) without joining the broadcast: the
    trainer does not wait for it, closes the group on both sides, and its next send opens a new
    one and lands (in pause mode wait)."""
    rc, lines = run_trainer(
        root,
        noisy(original, seed=13),
        tmp_path,
        sends=2,
        pause_modes=["sideways", "wait"],
        weight_version="w",
        timeout=20,
    )
    assert rc == 0
    refused, landed = lines[-1]["answers"]
    assert refused["error"]["status"] == 400 and refused["error"]["param"] == "pause_mode"
    assert landed["weight_version"] == "w"
    assert answer(client)["weight_version"] == "w"


# ------------------------------------------------------------------------------ the routes
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/update_weights",
            {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "x": 1}},
            "x",
        ),
        ("/update_weights", {"update_info": {"path": "/nonexistent", "names_": 1}}, "names_"),
        (
            "/init_weight_transfer_engine",
            {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "nccl": 1}},
            "nccl",
        ),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "bogus": True}, "bogus"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "zzz": 0}, "zzz"),
        ("/destroy_weights_update_group", {"group_name": "g", "extra": 1}, "extra"),
    ],
)
def test_unknown_fields_are_400s_naming_them(policy, root, path, body, param):
    r = httpx.post(f"{root}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].endswith(param)


def test_route_refusals(policy, root):
    post = lambda p, b: httpx.post(f"{root}{p}", json=b, timeout=30)  # noqa: E731
    meta = {"names": [NORM], "dtype_names": ["float32"], "shapes": [[64]]}
    r = post("/update_weights", {"update_info": meta})
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_weight_transfer_group"
    r = post("/update_weights", {"update_info": {**meta, "dtype_names": ["float33"]}})
    assert r.status_code == 400 and "float33" in r.json()["error"]["message"]
    r = post("/update_weights", {"update_info": {**meta, "is_checkpoint_format": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "update_info.is_checkpoint_format"
    sg = {"names": [NORM], "dtypes": ["float32"], "shapes": [[64]]}
    r = post("/update_weights_from_distributed", {**sg, "flush_cache": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "flush_cache"
    r = post("/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert r.status_code == 501 and "CUDA IPC" in r.json()["error"]["message"]
    r = post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rank_offset"
    r = post("/destroy_weights_update_group", {})
    assert r.status_code == 200 and r.json()["message"] == "No group open."


def test_init_times_out_when_no_trainer_joins(policy, root):
    """No trainer at the rendezvous: a 400 weight_transfer_failed after the timeout asked for."""
    from gymserve.trainer import free_port

    body = {"init_info": {"master_address": "127.0.0.1", "master_port": free_port(), "timeout": 2}}
    r = httpx.post(f"{root}/init_weight_transfer_engine", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "weight_transfer_failed"
    assert "within 2 s" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------ pure functions
def test_parse_metadata_and_bucket_layout():
    metas = parse_metadata(["a", "b", "c"], ["float32", "torch.bfloat16", "int64"], [[2, 3], [4], []])
    assert [m.nbytes for m in metas] == [24, 8, 8]
    assert bucket_layout(metas, 0) == [[0], [1], [2]]
    assert bucket_layout(metas, 32) == [[0, 1], [2]]
    assert bucket_layout(metas, 16) == [[0], [1, 2]]  # a tensor larger than a bucket travels alone
    for names, dtypes, shapes, param in [
        (["a"], ["float32", "float32"], [[1]], "dtype_names"),
        (["a", "a"], ["float32"] * 2, [[1], [1]], "names"),
        (["a"], ["float32"], [[-1]], "shapes"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            parse_metadata(names, dtypes, shapes)
        assert e.value.param == param
