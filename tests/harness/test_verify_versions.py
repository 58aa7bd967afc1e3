"""verify-rollouts per weight version: rollouts from a real gymserve on 127.0.0.1 (tiny model)
whose weights change between and during calls — a full update, a LoRA adapter, and a ``keep``
pause whose answer spans two versions — each token checked on its own version's weights."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import torch

from gymserve.harness.verify import load_model, main_verify
from gymserve.harness.verify_versions import parse_weights, token_versions, verify_by_version
from gymserve.server.embed import serve_policy

NORM = "model.norm.weight"


def _lora_dir(model, path, seed):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    peft_model.save_pretrained(str(path))
    return get_peft_model_state_dict(peft_model), cfg


def _turn(msg):
    keys = (
        "prompt_token_ids",
        "generation_token_ids",
        "generation_log_probs",
        "weight_version",
        "weight_version_spans",
    )
    return {k: msg.get(k) for k in keys}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tokenizer, tmp_path_factory):
    """Rollouts answered by four versions, and the directory of each version's weights."""
    out = tmp_path_factory.mktemp("versions")
    base = load_model(tiny_model_dir)
    srv = serve_policy(
        load_model(tiny_model_dir),
        tokenizer,
        backend_config={
            "sampling": {"temperature": 1.0},
            "num_threads": 1,
            "tool_call_parser": "none",
            "pause_timeout": 60,
        },
    )
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def ask(text, max_tokens=6):
        msg = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens
        )
        return msg.choices[0].message.model_extra

    rollouts = []
    try:
        rollouts.append({"id": "v0", "turns": [_turn(ask("one"))]})
        # Version "full-1": new full weights, saved where verify-rollouts reads them.
        state = {k: v.clone() for k, v in base.state_dict().items()}
        state[NORM] = state[NORM] * 1.7
        full = load_model(tiny_model_dir)
        full.load_state_dict(state)
        full.save_pretrained(str(out / "full-1"))
        srv.update_weights({NORM: state[NORM]}, weight_version="full-1")
        rollouts.append({"id": "full-1", "turns": [_turn(ask("two"))]})
        # A keep pause mid-generation, then version "full-2": one answer spans both versions.
        state2 = dict(state)
        state2[NORM] = state[NORM] * 0.6
        full2 = load_model(tiny_model_dir)
        full2.load_state_dict(state2)
        full2.save_pretrained(str(out / "full-2"))
        result: dict = {}
        seen = []

        def stream():
            for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "three"}], max_tokens=60, stream=True
            ):
                choice = chunk.choices[0] if chunk.choices else None
                if choice is not None and choice.delta.content:
                    seen.append(choice.delta.content)
                if choice is not None and choice.finish_reason:
                    result.update(choice.delta.model_extra or {})

        worker = threading.Thread(target=stream, daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        while len(seen) < 3:
            assert time.monotonic() < deadline, "no tokens streamed"
            time.sleep(0.005)
        srv.pause_generation("keep", timeout=60)
        srv.update_weights({NORM: state2[NORM]}, weight_version="full-2")
        srv.resume_generation()
        worker.join(60)
        assert len(result.get("weight_version_spans") or []) == 2, result
        rollouts.append({"id": "spans", "turns": [_turn(result)]})
        # Back to the base weights, then a LoRA adapter on them (version "lora-3").
        srv.update_weights({NORM: base.state_dict()[NORM]}, weight_version=0)
        tensors, cfg = _lora_dir(load_model(tiny_model_dir), out / "lora-3", seed=3)
        srv.load_lora_adapter(model, tensors=tensors, config=cfg, weight_version="lora-3")
        rollouts.append({"id": "lora", "turns": [_turn(ask("four"))]})
        srv.unload_lora_adapter(model)
    finally:
        srv.stop()
    base.save_pretrained(str(out / "base"))
    weights = {
        0: str(out / "base"),
        "full-1": str(out / "full-1"),
        "full-2": str(out / "full-2"),
        "lora-3": str(out / "lora-3"),
    }
    return rollouts, weights, out


def test_every_token_checks_on_the_weights_of_its_version(served, tiny_model_dir):
    rollouts, weights, _ = served
    assert [r["turns"][0]["weight_version"] for r in rollouts] == [0, "full-1", "full-1", "lora-3"]
    assert [s["version"] for s in rollouts[2]["turns"][0]["weight_version_spans"]] == ["full-1", "full-2"]
    report = verify_by_version(rollouts, weights, base=str(tiny_model_dir), tolerance=1e-3)
    assert report.ok, [(c.id, c.max_diff) for c in report.checks]
    assert report.num_tokens == sum(len(r["turns"][0]["generation_token_ids"]) for r in rollouts)
    assert all(not c.unchecked for c in report.checks)
    # Checked on the wrong version, the spanning answer and the adapter's answer fail.
    wrong = {v: weights[0] for v in weights}
    bad = verify_by_version(rollouts, wrong, base=str(tiny_model_dir), tolerance=1e-3)
    assert {c.id for c in bad.checks if c.max_diff and c.max_diff > 1e-3} == {"full-1", "spans", "lora"}


def test_turns_without_weights_are_named_and_left_out(served, tiny_model_dir, tmp_path, capsys):
    rollouts, weights, out = served
    path = tmp_path / "rollouts.jsonl"
    unversioned = {"id": "old", "turns": [{**rollouts[0]["turns"][0], "weight_version": None}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rollouts, unversioned]))
    specs = [f"{v}={d}" for v, d in weights.items() if v != "full-2"]
    code = main_verify(str(path), model=str(tiny_model_dir), tolerance=1e-3, weights=specs)
    text = capsys.readouterr().out
    assert code == 0 and "PASS" in text
    assert "not checked: 2 turns" in text
    assert "spans: turn 0:" in text and "of version 'full-2', which has no --weights" in text
    assert "old: turn 0:" in text and "say no weight_version" in text


def test_versions_served_by_the_llamacpp_engine_check_on_llama_cpp(tiny_model_dir, tiny_gguf_dir, tmp_path):
    """``--engine llamacpp``: each version scores on llama.cpp as the engine served it — a new GGUF
    file (full weights) and a PEFT adapter applied unmerged on the base GGUF."""
    import asyncio

    pytest.importorskip(
        "llama_cpp", reason='the llamacpp engine needs llama-cpp-python: pip install "gymserve[llamacpp]"'
    )
    from gymserve.engine.base import SamplingParams
    from gymserve.engine.llamacpp_engine import LlamaCppEngine
    from helpers.tiny_gguf import perturbed_gguf_dir

    new = perturbed_gguf_dir(tiny_model_dir, tiny_gguf_dir, tmp_path / "v1")
    _lora_dir(load_model(tiny_model_dir), tmp_path / "lora", seed=3)
    eng = LlamaCppEngine(tiny_gguf_dir / "model.gguf", tokenizer_dir=tiny_gguf_dir, num_threads=2)
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    prompt = list(range(1000, 1020))

    async def serve():
        out = [await eng.generate(prompt, sp)]
        await eng.update_weights(path=new / "model.gguf", weight_version="v1")
        out.append(await eng.generate(prompt, sp))
        await eng.update_weights(path=tiny_gguf_dir / "model.gguf", weight_version=0)
        await eng.load_lora_adapter("a", str(tmp_path / "lora"), weight_version="lora")
        out.append(await eng.generate(prompt, sp))
        return out

    try:
        gens = asyncio.run(serve())
    finally:
        asyncio.run(eng.close())
    rollouts = []
    for g in gens:
        (span,) = g.weight_version_spans  # each call ran on one version
        turn = {
            "prompt_token_ids": prompt,
            "generation_token_ids": g.token_ids,
            "generation_log_probs": g.log_probs,
            "weight_version": span["version"],
        }
        rollouts.append({"id": str(span["version"]), "turns": [turn]})
    assert [r["id"] for r in rollouts] == ["0", "v1", "lora"]
    weights = parse_weights([f"0={tiny_gguf_dir}", f"v1={new}", f"lora={tmp_path / 'lora'}"])
    report = verify_by_version(rollouts, weights, base=str(tiny_gguf_dir), tolerance=1e-3, engine="llamacpp")
    assert report.ok and report.num_tokens == sum(len(g.token_ids) for g in gens), [
        (c.id, c.max_diff) for c in report.checks
    ]
    wrong = verify_by_version(
        rollouts, {v: str(tiny_gguf_dir) for v in weights}, base=str(tiny_gguf_dir), tolerance=1e-3, engine="llamacpp"
    )
    assert {c.id for c in wrong.checks if c.max_diff and c.max_diff > 1e-3} == {"v1", "lora"}


def test_weights_specs_and_token_versions():
    assert parse_weights(["3=/tmp", "step-4=/tmp", "0=embedded"]) == {3: "/tmp", "step-4": "/tmp", 0: "embedded"}
    assert parse_weights(["3=/tmp"]) == {3: "/tmp"}
    for bad in ("3", "=/tmp", "3=", "3=/no/such/dir", "3=/no/such/file.gguf"):
        with pytest.raises(ValueError, match="--weights"):
            parse_weights([bad])
    spans = [{"version": 1, "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 5}]
    assert token_versions({"weight_version": 1, "weight_version_spans": spans}, 5) == [1, 1, 2, 2, 2]
    assert token_versions({"weight_version": "v"}, 2) == ["v", "v"]
    assert token_versions({}, 1) == [None]
