"""Contiguity checks and teacher-forced log-probs on the tiny random-weight model."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gymserve.harness.verify import (
    check_contiguity,
    load_model,
    main_verify,
    rollout_log_prob_diffs,
    rollout_turns,
    teacher_forced_log_probs,
    verify_rollouts,
)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_model(tiny_model_dir)


def _incremental_log_probs(model, prompt, gen):
    """Independent reference: KV-cache decoding one token at a time (how an engine samples)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        past, logits = out.cache, out.logits[0, -1]  # transformers 5 names the KV cache "cache"
        lps = []
        for tok in gen:
            lps.append(torch.log_softmax(logits.float(), -1)[tok].item())
            out = model(input_ids=torch.tensor([[tok]]), cache=past, use_cache=True)
            past, logits = out.cache, out.logits[0, -1]
    return lps


def test_teacher_forcing_matches_incremental_decoding(tiny_model):
    rng = random.Random(1)
    prompt = [rng.randrange(0, 150000) for _ in range(30)]
    gen = [rng.randrange(0, 150000) for _ in range(12)]
    tf = teacher_forced_log_probs(tiny_model, prompt, gen)
    ref = _incremental_log_probs(tiny_model, prompt, gen)
    assert len(tf) == 12 and all(isinstance(x, float) for x in tf)
    assert max(abs(a - b) for a, b in zip(tf, ref)) < 1e-4
    assert teacher_forced_log_probs(tiny_model, prompt, []) == []
    with pytest.raises(ValueError):
        teacher_forced_log_probs(tiny_model, [], gen)


def _rollout(model, rid="r1", *, turns=3, seed=0):
    """A contiguous multi-turn rollout in the ``gymserve rollout`` format with exact log-probs."""
    rng = random.Random(seed)
    prompt = [rng.randrange(0, 150000) for _ in range(10)]
    ts = []
    for _ in range(turns):
        gen = [rng.randrange(0, 150000) for _ in range(rng.randrange(1, 6))]
        ts.append(
            {
                "prompt_token_ids": prompt,
                "generation_token_ids": gen,
                "generation_log_probs": teacher_forced_log_probs(model, prompt, gen),
            }
        )
        prompt = prompt + gen + [rng.randrange(0, 150000) for _ in range(4)]  # e.g. a tool output
    output = [{"type": "message", **t} for t in ts]
    return {"id": rid, "output": output, "turns": ts}


def _write(path, rollouts):
    path.write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    return str(path)


def test_contiguity_checks():
    a = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-1.0]}
    b = {"prompt_token_ids": [1, 2, 3, 4], "generation_token_ids": [5], "generation_log_probs": [-1.0]}
    assert check_contiguity([a, b]).ok and check_contiguity([a]).ok
    bad = check_contiguity([a, {**b, "prompt_token_ids": [1, 2, 7, 4]}])
    assert not bad.ok and bad.turn == 1 and "position 2" in bad.reason
    short = check_contiguity([a, {**b, "prompt_token_ids": [1, 2]}])
    assert not short.ok and "fewer" in short.reason
    assert check_contiguity([a, None]).reason == "no token fields"
    # Without a "turns" list the token-carrying output items are the turns.
    assert rollout_turns({"output": [{"type": "function_call_output", "output": "x"}, {"type": "message", **a}]}) == [a]


def test_contiguous_file_passes(tiny_model, tiny_model_dir, tmp_path, capsys):
    rollouts = [_rollout(tiny_model, f"r{i}", turns=1 + i % 3, seed=i) for i in range(4)]
    rollouts.append({"id": "no-calls", "turns": [], "output": [], "error": {"message": "refused"}})  # skipped
    report = verify_rollouts(rollouts, tiny_model)
    assert report.total == 4 and report.contiguity_ok and report.max_diff < 1e-5 and report.ok
    # The multi-turn path (one pass over the last turn) agrees with per-turn passes.
    turns = rollout_turns(rollouts[2])
    one_pass = rollout_log_prob_diffs(tiny_model, turns, contiguous=True)
    per_turn = rollout_log_prob_diffs(tiny_model, turns, contiguous=False)
    assert len(one_pass) == len(per_turn) == sum(len(t["generation_token_ids"]) for t in turns)
    assert main_verify(_write(tmp_path / "ok.jsonl", rollouts), str(tiny_model_dir)) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "4/4 rollouts token-contiguous (100.0%)" in out and "PASS" in out
    # No --tolerance: the one that fits the weights, said with its reason (fp32 here).
    assert "tolerance 0.0001: unquantized weights" in captured.err


def test_broken_contiguity_fails(tiny_model, tiny_model_dir, tmp_path, capsys):
    good = _rollout(tiny_model, "good", seed=1)
    broken = _rollout(tiny_model, "broken", seed=2)
    broken["turns"][2]["prompt_token_ids"] = list(broken["turns"][2]["prompt_token_ids"])
    broken["turns"][2]["prompt_token_ids"][3] += 1  # retokenization drift in the history
    # Log-probs stay exact for the (now different) prompt: only contiguity fails.
    t = broken["turns"][2]
    t["generation_log_probs"] = teacher_forced_log_probs(tiny_model, t["prompt_token_ids"], t["generation_token_ids"])
    assert main_verify(_write(tmp_path / "broken.jsonl", [good, broken]), str(tiny_model_dir)) == 1
    out = capsys.readouterr().out
    assert "1/2 rollouts token-contiguous (50.0%)" in out and "broken: not contiguous at turn 2" in out
    assert "FAIL" in out


def test_perturbed_log_prob_fails(tiny_model, tiny_model_dir, tmp_path, capsys):
    r = _rollout(tiny_model, "p", seed=3)
    r["turns"][1]["generation_log_probs"][0] += 1e-3
    report = verify_rollouts([r], tiny_model)
    assert report.contiguity_ok and 9e-4 < report.max_diff < 1.1e-3 and not report.ok
    path = _write(tmp_path / "perturbed.jsonl", [r])
    assert main_verify(path, str(tiny_model_dir)) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main_verify(path, str(tiny_model_dir), tolerance=1e-2) == 0  # the tolerance is configurable


def test_bad_inputs(tmp_path, tiny_model_dir):
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{not json\n')
    assert main_verify(str(tmp_path / "bad.jsonl"), str(tiny_model_dir)) == 2
    assert main_verify(str(tmp_path / "missing.jsonl"), str(tiny_model_dir)) == 2
    partial = {"id": "x", "turns": [{"prompt_token_ids": [1], "generation_token_ids": [2]}]}
    report = verify_rollouts([partial])
    assert not report.ok and "must come together" in report.checks[0].error
