"""The replica side of a fleet-wide weight change, without Ray: ``EngineReplica.serving`` around a
real local backend on the tiny model. A change kept for undo is put back bit for bit under the old
version (full updates, renames, LoRA loads and swaps); a refused change comes back as an error
payload and changes nothing; one replica's served state copies into another."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gymserve.backends.local import LocalBackend
from gymserve.config import LocalBackendConfig
from gymserve.errors import ConflictError, WeightUpdateError
from gymserve.ray_cluster.replica import ERROR_KEY, EngineReplica

NORM = "model.norm.weight"


def _replica(tiny_model_dir, name="replica-0") -> EngineReplica:
    cfg = LocalBackendConfig(model=str(tiny_model_dir), num_threads=1, tool_call_parser="none", max_num_seqs=2)
    return EngineReplica.serving(name, LocalBackend.from_config(cfg))


def _state(replica) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in replica.backend.engine.model.state_dict().items()}


def _lora(model, rank=4, seed=0):
    from peft import LoraConfig

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, layer in model.named_modules():
        if name.endswith("self_attn.q_proj"):
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=gen)
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=gen)
    return tensors, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj"])


def test_apply_then_rollback_restores_weights_version_and_adapter(tiny_model_dir):
    async def run():
        rep = _replica(tiny_model_dir)
        try:
            before = _state(rep)
            model = rep.backend.engine.model
            # A full update, kept for undo, then undone: every tensor and the version come back.
            new = {k: v + 0.5 for k, v in before.items() if v.is_floating_point()}
            got = await rep.apply("t1", "update_weights", new, {"weight_version": "step-1"})
            assert got == {"weight_version": "step-1"}
            assert not torch.equal(model.state_dict()[NORM], before[NORM])
            assert (await rep.rollback("t1")) == {"weight_version": 0}
            after = _state(rep)
            assert all(torch.equal(after[k], before[k]) for k in before)
            assert (await rep.control_status())["weight_version"] == 0
            # A rename only, undone.
            assert (await rep.apply("t2", "update_weight_version", None, {"new_version": "v9"})) == {
                "weight_version": "v9"
            }
            await rep.rollback("t2")
            assert rep.backend.engine.weight_version == 0
            # A LoRA load, committed; then a swap, undone: the first adapter serves again, bit for bit.
            tensors, config = _lora(model, seed=1)
            await rep.apply(
                "t3", "load_lora_adapter", tensors, {"lora_name": "a", "config": config, "weight_version": 1}
            )
            await rep.commit("t3")
            with_a = _state(rep)
            tensors2, config2 = _lora(model, seed=2)
            await rep.apply(
                "t4",
                "load_lora_adapter",
                tensors2,
                {"lora_name": "b", "config": config2, "load_inplace": True, "weight_version": 2},
            )
            assert rep.backend.engine.lora_adapters()[0]["name"] == "b"
            assert (await rep.rollback("t4")) == {"weight_version": 1}
            assert rep.backend.engine.lora_adapters()[0]["name"] == "a"
            assert all(torch.equal(v, with_a[k]) for k, v in _state(rep).items())
            # ...and unloading after the rollback restores the base weights exactly.
            await rep.apply("t5", "unload_lora_adapter", None, {"lora_name": "a", "weight_version": 3})
            assert all(torch.equal(v, before[k]) for k, v in _state(rep).items())
        finally:
            await rep.shutdown()

    asyncio.run(run())


def test_refused_change_is_an_error_payload_and_changes_nothing(tiny_model_dir):
    async def run():
        rep = _replica(tiny_model_dir)
        try:
            before = _state(rep)
            bad = {NORM: torch.zeros(3)}
            got = await rep.apply("t1", "update_weights", bad, {"weight_version": 5})
            assert isinstance(got[ERROR_KEY], WeightUpdateError) and NORM in got[ERROR_KEY].message
            assert rep.backend.engine.weight_version == 0
            assert all(torch.equal(v, before[k]) for k, v in _state(rep).items())
            # Nothing kept for a refused change: its rollback is a no-op on the current version.
            assert (await rep.rollback("t1")) == {"weight_version": 0}
            tensors, config = _lora(rep.backend.engine.model)
            await rep.apply("t2", "load_lora_adapter", tensors, {"lora_name": "a", "config": config})
            got = await rep.apply("t3", "update_weights", {NORM: before[NORM]}, {})
            assert isinstance(got[ERROR_KEY], ConflictError) and got[ERROR_KEY].code == "lora_adapter_merged"
        finally:
            await rep.shutdown()

    asyncio.run(run())


def test_export_import_copies_weights_version_and_adapter(tiny_model_dir):
    async def run():
        a, b = _replica(tiny_model_dir, "replica-0"), _replica(tiny_model_dir, "replica-1")
        try:
            model = a.backend.engine.model
            await a.apply("t1", "update_weights", {NORM: model.state_dict()[NORM] * 2}, {"weight_version": "v1"})
            tensors, config = _lora(model)
            await a.apply(
                "t2", "load_lora_adapter", tensors, {"lora_name": "a", "config": config, "weight_version": "v2"}
            )
            assert (await b.import_weights(await a.export_weights())) == {"weight_version": "v2"}
            sa, sb = _state(a), _state(b)
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
            assert b.backend.engine.lora_adapters()[0]["name"] == "a"
            # The copied adapter state is whole: unloading on b restores a's base (v1) weights.
            await b.apply("t3", "unload_lora_adapter", None, {"lora_name": "a", "weight_version": "v3"})
            await a.apply("t3", "unload_lora_adapter", None, {"lora_name": "a", "weight_version": "v3"})
            sa, sb = _state(a), _state(b)
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("op", ["delete_everything"])
def test_unknown_operation_is_refused(tiny_model_dir, op):
    async def run():
        rep = _replica(tiny_model_dir)
        try:
            got = await rep.apply("t", op, None, {})
            assert got[ERROR_KEY].status_code == 400 and op in got[ERROR_KEY].message
        finally:
            await rep.shutdown()

    asyncio.run(run())
