"""The tiny policy served for control tests, new weights for it, and the check that answers came
from the weights they name.

``serve_tiny(model_dir, tokenizer, seed=...)`` serves it with a real gymserve (``serve_policy``);
``weights_of(model_dir)`` is its own state dict; ``noisy(state, seed)`` changes two of its tensors
enough to change its answers (a subset update); ``check_teacher_forced(ref, states, fields)``
teacher-forces an answer's tokens on the weights of each version that sampled them
(``weight_version`` / ``weight_version_spans``).
"""

from __future__ import annotations

from typing import Any

import torch

from gymserve.harness.verify import load_model, teacher_forced_log_probs
from gymserve.server.embed import PolicyServer, serve_policy

NORM = "model.norm.weight"  # noise here changes the answers of the random tiny model
DOWN = "model.layers.1.mlp.down_proj.weight"


def serve_tiny(model_dir: Any, tokenizer: Any, *, seed: int) -> PolicyServer:
    """The tiny model behind a real gymserve on 127.0.0.1: seeded sampling (the same answer for the
    same weights, random text: a text delta per token for streams), one thread, no tool parser, a
    120 s pause deadline."""
    return serve_policy(
        load_model(model_dir),
        tokenizer,
        backend_config={
            "sampling": {"temperature": 1.0, "seed": seed},
            "num_threads": 1,
            "tool_call_parser": "none",
            "pause_timeout": 120,
        },
    )


def weights_of(model_dir: Any) -> dict[str, torch.Tensor]:
    """A copy of the tiny model's own state dict."""
    return {k: v.clone() for k, v in load_model(model_dir).state_dict().items()}


def noisy(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New values for two of the model's 26 tensors (a subset update) that change its answers."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: state[name] + scale * torch.randn(state[name].shape, generator=gen)
        for name, scale in ((NORM, 20.0), (DOWN, 0.05))
    }


def check_teacher_forced(ref: Any, states: dict[Any, dict[str, torch.Tensor]], f: dict[str, Any]) -> None:
    """Each token's reported log-prob equals teacher forcing on the weights of its version
    (``states``: version → state dict; ``ref``: the model loaded with each in turn)."""
    spans = f.get("weight_version_spans") or [
        {"version": f["weight_version"], "start": 0, "end": len(f["generation_token_ids"])}
    ]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == len(f["generation_token_ids"])
    for span in spans:
        ref.load_state_dict(states[span["version"]])
        tf = teacher_forced_log_probs(ref, f["prompt_token_ids"], f["generation_token_ids"])
        got = f["generation_log_probs"]
        s, e = span["start"], span["end"]
        assert max(abs(a - b) for a, b in zip(tf[s:e], got[s:e])) < 1e-4, span
