"""``gymserve train-demo`` on the tiny random-weight model: three GRPO steps on a LoRA through a real
gymserve on 127.0.0.1, each update pushed over HTTP and proved by the next rollouts (version,
teacher forcing); and the loop's checks fail when the served weights are not the trainer's."""

from __future__ import annotations

import json

import pytest
import torch

from gymserve.cli import main
from gymserve.harness.rl_loop import LoopCheckError, LoopConfig, check_rollouts, one_word_reward, run_loop
from gymserve.harness.rl_policy import Rollout, advantages, kl_k3
from gymserve.harness.verify import load_model
from gymserve.server.embed import serve_policy


def test_train_demo_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train-demo",
            "--model",
            str(tiny_model_dir),
            "--steps",
            "3",
            "--prompts",
            "2",
            "--group",
            "3",
            "--max-tokens",
            "6",
            "--lr",
            "0.05",
            "--out",
            str(out),
            "--num-threads",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads((out / "steps.json").read_text())
    steps = summary["steps"]
    assert [s["weight_version"] for s in steps] == [0, 1, 2] and summary["final_version"] == 3
    assert [s["next_version"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["rollouts"] == 6 and s["tf_max_diff"] < 1e-3
        assert 0.0 <= s["reward"] <= 1.0 and s["update_seconds"] > 0
    assert steps[0]["kl_to_previous"] is None and all(s["kl_to_previous"] >= 0 for s in steps[1:])
    assert any(s["kl_to_previous"] > 1e-6 for s in steps[1:]), "the updates never changed the policy"
    assert summary["final_tf_max_diff"] < 1e-3 and summary["first_step_on_base_tf_max_diff"] < 1e-3
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rollouts] == [0] * 6 + [1] * 6 + [2] * 6
    assert all(len(r["gen_ids"]) == len(r["log_probs"]) > 0 for r in rollouts)
    assert all(r["reward"] == one_word_reward(r["text"], r["finish_reason"]) for r in rollouts)
    for k in (1, 2, 3):  # every version's adapter stays on disk, in PEFT's format
        assert (out / f"step-{k}" / "adapter_model.safetensors").is_file()
    assert printed.count("\nstep ") + printed.startswith("step ") == 3 and "kl_prev" in printed


def test_the_check_fails_when_the_served_weights_differ(tiny_model_dir, tokenizer, tmp_path):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # a different policy than the trainer's copy of the model dir
    srv = serve_policy(
        model, tokenizer, model_name="tiny", backend_config={"num_threads": 1, "tool_call_parser": "none"}
    )
    try:
        with pytest.raises(LoopCheckError, match="differ from teacher forcing"):
            run_loop(
                srv.base_url, tiny_model_dir, LoopConfig(steps=1, prompts=1, group=2, max_tokens=4, out=str(tmp_path))
            )
    finally:
        srv.stop()


def _rollout(group: int, reward: float, version=1, **kw) -> Rollout:
    return Rollout(
        group=group,
        prompt="p",
        prompt_ids=[1],
        gen_ids=[2],
        log_probs=[-1.0],
        weight_version=version,
        finish_reason=kw.pop("finish_reason", "stop"),
        text="x",
        reward=reward,
        **kw,
    )


def test_checks_and_estimators():
    check_rollouts([_rollout(0, 0.0), _rollout(0, 1.0)], 1)
    with pytest.raises(LoopCheckError, match="weight_version 0, expected 1"):
        check_rollouts([_rollout(0, 0.0), _rollout(0, 0.0, version=0)], 1)
    with pytest.raises(LoopCheckError, match="spans a weight update"):
        check_rollouts([_rollout(0, 0.0, spans=[{"version": 0, "start": 0, "end": 1}])], 1)
    with pytest.raises(LoopCheckError, match="aborted"):
        check_rollouts([_rollout(0, 0.0, finish_reason="abort")], 1)
    adv = advantages([_rollout(0, 1.0), _rollout(0, 0.0), _rollout(1, 0.5), _rollout(1, 0.5)])
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[1] == pytest.approx(-1.0, abs=1e-5) and adv[2:] == [0.0, 0.0]
    same = [torch.tensor([-1.0, -2.0])]
    assert kl_k3(same, same) == 0.0
    # k3 of a known pair: ρ = e^{-0.5}, ρ - 1 - log ρ = e^{-0.5} - 0.5
    assert kl_k3([torch.tensor([-1.0])], [torch.tensor([-1.5])]) == pytest.approx(0.1065307, abs=1e-6)
    assert one_word_reward("Blue", "stop") == 1.0 and one_word_reward("Red.", "stop") == 1.0
    assert one_word_reward("An orange.", "stop") == 0.5 and one_word_reward("A color in", "length") == pytest.approx(
        1 / 6
    )
    assert one_word_reward("42", "stop") == 0.0
