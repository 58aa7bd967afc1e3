"""Reading and validating weight updates (``gymserve.engine.weights``) against the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gymserve.engine.weights import apply_plan, load_update, plan_update, read_safetensors, safetensors_files
from gymserve.errors import WeightUpdateError
from gymserve.harness.verify import load_model

NORM = "model.norm.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def _check(info, param: str | None = None) -> WeightUpdateError:
    """The refusal is a 400 ``invalid_weights`` naming ``param`` (the tensor or file)."""
    err = info.value
    assert err.status_code == 400 and err.code == "invalid_weights"
    if param is not None:
        assert err.param == param, err.param
    return err


def test_directory_layouts(tmp_path, tiny_model_dir):
    assert safetensors_files(tiny_model_dir) == [tiny_model_dir / "model.safetensors"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({NORM: torch.ones(64)}, str(sharded / "a.safetensors"))
    save_file({DOWN: torch.zeros(64, 128)}, str(sharded / "b.safetensors"))
    save_file({"ignored": torch.zeros(1)}, str(sharded / "not-in-index.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {NORM: "a.safetensors", DOWN: "b.safetensors"}})
    )
    got = read_safetensors(sharded)
    assert sorted(got) == [DOWN, NORM] and torch.equal(got[NORM], torch.ones(64))
    loose = tmp_path / "loose"
    loose.mkdir()
    save_file({NORM: torch.ones(64)}, str(loose / "x.safetensors"))
    save_file({DOWN: torch.ones(64, 128)}, str(loose / "y.safetensors"))
    assert sorted(read_safetensors(loose)) == [DOWN, NORM]
    assert list(read_safetensors(loose / "x.safetensors")) == [NORM]


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "no such file or directory"),
        ("empty", "no .safetensors files"),
        ("not-safetensors", "not a .safetensors file"),
        ("bad-index", "unreadable index"),
        ("index-missing-shard", "lists shard gone.safetensors"),
        ("corrupt", "cannot read safetensors file"),
        ("duplicate", "is in both"),
    ],
)
def test_unreadable_sources_name_the_file(tmp_path, case, match):
    d = tmp_path / "ckpt"
    d.mkdir()
    target = d
    if case == "missing":
        target = tmp_path / "nowhere"
    elif case == "not-safetensors":
        target = d / "weights.bin"
        target.write_bytes(b"\0" * 16)
    elif case == "bad-index":
        (d / "model.safetensors.index.json").write_text("{not json")
    elif case == "index-missing-shard":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {NORM: "gone.safetensors"}}))
    elif case == "corrupt":
        (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    elif case == "duplicate":
        save_file({NORM: torch.ones(64)}, str(d / "a.safetensors"))
        save_file({NORM: torch.ones(64)}, str(d / "b.safetensors"))
    with pytest.raises(WeightUpdateError, match=match) as info:
        read_safetensors(target)
    _check(info)
    assert info.value.param and (case == "duplicate" or str(tmp_path) in info.value.param)
    if case != "duplicate":
        assert str(tmp_path) in info.value.message  # the message names the file or directory


@pytest.mark.parametrize(
    "tensors, param, match",
    [
        ({"model.norm.weigth": torch.ones(64)}, "model.norm.weigth", "unknown name.*did you mean 'model.norm.weight'"),
        ({NORM: torch.ones(65)}, NORM, r"shape \[65\], the served model's is \[64\]"),
        (
            {NORM: torch.ones(64, dtype=torch.bfloat16)},
            NORM,
            "dtype torch.bfloat16, the served model's is torch.float32",
        ),
        ({NORM: torch.tensor([float("nan")] * 64)}, NORM, "64 NaN or infinite values"),
        ({DOWN: torch.full((64, 128), float("inf"))}, DOWN, "8192 NaN or infinite values"),
        ({NORM: [1.0] * 64}, NORM, "is a list, not a torch.Tensor"),
        ({}, None, "holds no tensors"),
    ],
)
def test_bad_tensors_are_refused_before_anything_changes(model, tensors, param, match):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = {DOWN: torch.zeros(64, 128)} if tensors else {}
    with pytest.raises(WeightUpdateError, match=match) as info:
        plan_update(model, {**good, **tensors})
    _check(info, param)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_every_problem_is_listed_and_tied_tensors_must_agree(model):
    with pytest.raises(WeightUpdateError, match="3 problems") as info:
        plan_update(model, {"nope": torch.ones(1), NORM: torch.ones(3), DOWN: torch.ones(64, 128, dtype=torch.float64)})
    _check(info, "nope")
    assert all(name in info.value.message for name in ("'nope'", NORM, DOWN))
    emb = model.state_dict()["model.embed_tokens.weight"]
    # lm_head.weight is tied to the embedding: one value may come under either name, two must agree.
    assert len(plan_update(model, {"lm_head.weight": emb + 1, "model.embed_tokens.weight": emb + 1})) == 2
    with pytest.raises(WeightUpdateError, match="tied to 'model.embed_tokens.weight'") as info:
        plan_update(model, {"model.embed_tokens.weight": emb + 1, "lm_head.weight": emb + 2})
    _check(info, "lm_head.weight")
    with pytest.raises(WeightUpdateError, match="mapping of tensor names"):
        plan_update(model, [("x", torch.ones(1))])


def test_a_valid_update_copies_in_place(model, tmp_path):
    params_before = {n: p.data_ptr() for n, p in model.named_parameters()}
    new = torch.randn(64, 128)
    apply_plan(plan_update(model, {DOWN: new, NORM: torch.full((64,), 2.0)}))
    sd = model.state_dict()
    assert torch.equal(sd[DOWN], new) and torch.equal(sd[NORM], torch.full((64,), 2.0))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params_before  # same storage, new values
    save_file({NORM: torch.full((64,), 3.0)}, str(tmp_path / "model.safetensors"))
    apply_plan(load_update(model, path=tmp_path))
    assert torch.equal(model.state_dict()[NORM], torch.full((64,), 3.0))
    # Finite values whose sum overflows float32 are still finite (the fast check's fallback).
    huge = torch.full((64,), 1e37)
    apply_plan(plan_update(model, {NORM: huge}))
    assert torch.equal(model.state_dict()[NORM], huge)
    with pytest.raises(WeightUpdateError, match="exactly one of"):
        load_update(model, {NORM: torch.ones(64)}, path=tmp_path)
