"""The trainer's side of ``gymserve train-demo``: a LoRA policy (PEFT) over a local copy of the served
model, teacher-forced log-probs of the tokens gymserve returned, a GRPO step, and the KL between two
versions.

Shapes: a rollout is ``prompt_ids`` (``P`` ints) + ``gen_ids`` (``G`` ints: ``generation_token_ids``,
the EOS that ended an answer included, so the loss masks nothing — the decision to stop is trained,
and it is what the one-word reward pays for); its log-probs are a
float32 tensor ``[G]``, ``log_softmax`` of the logits at positions ``P-1 … P+G-2`` (what gymserve's
engine reports in ``generation_log_probs``, and what ``verify.teacher_forced_log_probs`` computes).

The update is GRPO's (Shao et al., 2024, "DeepSeekMath", §4.1) in its on-policy form: one gradient
step per batch of rollouts, so the importance ratio is 1 and the clipped objective reduces to
REINFORCE with a group baseline: ``A_i = (r_i - mean_g r) / (std_g r + 1e-6)`` within each prompt's
group, loss ``-Σ_i A_i Σ_t log π(y_it) / Σ_i G_i`` (token-level normalisation, as in DAPO). The KL
between the version that sampled the rollouts (``π_old``) and the next (``π_new``) is Schulman's
``k3`` estimator over the sampled tokens: mean of ``ρ - 1 - log ρ`` with ``ρ = π_new / π_old`` —
unbiased for ``KL(π_old ‖ π_new)`` and never negative.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Rollout:
    """One sampled answer and what gymserve said about it (``log_probs``: ``generation_log_probs``)."""

    group: int
    prompt: str
    prompt_ids: list[int]
    gen_ids: list[int]
    log_probs: list[float]
    weight_version: Any
    finish_reason: str
    text: str
    reward: float = 0.0
    spans: list[dict[str, Any]] | None = None  # weight_version_spans: only when an update came mid-answer


class LoraPolicy:
    """A PEFT LoRA over the model in ``model_dir`` (float32, eval mode: no dropout) with an Adam
    optimizer. ``rank``/``alpha``: LoRA's ``r`` and ``lora_alpha``; ``layers``: adapt only the top
    ``layers`` decoder layers (the backward pass then stops there: cheap on CPU; 0 = all);
    ``target_modules``: the Linear layers adapted; ``lr``: Adam's learning rate; ``max_grad_norm``:
    gradient clipping."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        rank: int = 8,
        alpha: int = 16,
        layers: int = 4,
        target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
        lr: float = 2e-3,
        max_grad_norm: float = 1.0,
        seed: int = 0,
    ):
        import torch
        from peft import LoraConfig, get_peft_model

        from gymserve.engine.hf_models import MODEL_LOAD_LOCK
        from gymserve.harness.verify import load_model

        torch.manual_seed(seed)
        base = load_model(model_dir)
        n_layers = int(base.config.num_hidden_layers)
        chosen = list(range(max(0, n_layers - layers), n_layers)) if layers else None
        self.layers_adapted = len(chosen) if chosen else n_layers
        self.config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            target_modules=list(target_modules),
            layers_to_transform=chosen,
            bias="none",
        )
        with MODEL_LOAD_LOCK:  # builds modules: not while another thread's load has patched torch
            self.model = get_peft_model(base, self.config)
        self.model.eval()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.max_grad_norm = max_grad_norm

    # ---- log-probs ----------------------------------------------------------------------------
    def log_probs(self, rollouts: Sequence[Rollout], *, grad: bool = False, adapter: bool = True) -> list[Any]:
        """Teacher-forced log-probs of each rollout's ``gen_ids`` (one ``[G]`` tensor each), from one
        right-padded batch (padding after a sequence cannot change its causal logits); ``adapter``
        False gives the base model's (PEFT's ``disable_adapter``)."""
        import contextlib

        import torch

        seqs = [r.prompt_ids + r.gen_ids for r in rollouts]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        off = contextlib.nullcontext() if adapter else self.model.disable_adapter()
        with off, torch.set_grad_enabled(grad):
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            out = []
            for i, r in enumerate(rollouts):
                p, g = len(r.prompt_ids), len(r.gen_ids)
                lp = torch.log_softmax(logits[i, p - 1 : p + g - 1].float(), dim=-1)
                out.append(lp.gather(-1, ids[i, p : p + g].unsqueeze(-1)).squeeze(-1))
        return out

    # ---- the update ---------------------------------------------------------------------------
    def step(self, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        """One GRPO step on ``rollouts`` (see module docstring). Returns ``{"tf_max_diff": max |teacher
        forcing − gymserve's log-probs| over every token (before the step), "loss", "grad_norm",
        "kl": KL(π_old ‖ π_new) per token on these rollouts, "train_seconds"}``."""
        import torch

        t0 = time.perf_counter()
        lps = self.log_probs(rollouts, grad=True)
        diffs = [
            float((lp.detach() - torch.tensor(r.log_probs)).abs().max()) for lp, r in zip(lps, rollouts) if r.gen_ids
        ]
        adv = advantages(rollouts)
        tokens = max(1, sum(len(r.gen_ids) for r in rollouts))
        loss = -sum(a * lp.sum() for a, lp in zip(adv, lps)) / tokens
        self.optimizer.zero_grad()
        grad_norm = 0.0
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
            self.optimizer.step()
        old = [lp.detach() for lp in lps]
        new = self.log_probs(rollouts)
        return {
            "tf_max_diff": max(diffs, default=0.0),
            "loss": float(loss.detach() if isinstance(loss, torch.Tensor) else loss),
            "grad_norm": grad_norm,
            "kl": kl_k3(old, new),
            "train_seconds": time.perf_counter() - t0,
        }

    def save(self, path: str | os.PathLike) -> None:
        """The adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        self.model.save_pretrained(str(path), safe_serialization=True)


def advantages(rollouts: Sequence[Rollout]) -> list[float]:
    """GRPO's group-normalised advantage per rollout (0 for a group whose rewards are all equal)."""
    import statistics

    groups: dict[int, list[float]] = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(r.reward)
    stats = {g: (statistics.fmean(v), statistics.pstdev(v)) for g, v in groups.items()}
    return [(r.reward - stats[r.group][0]) / (stats[r.group][1] + 1e-6) for r in rollouts]


def kl_k3(old: Sequence[Any], new: Sequence[Any]) -> float:
    """Per-token ``k3`` estimate of ``KL(π_old ‖ π_new)`` from the two log-probs of the same sampled tokens."""
    import torch

    if not old or not any(len(o) for o in old):
        return 0.0
    log_ratio = torch.cat([n - o for o, n in zip(old, new)])
    return float((torch.exp(log_ratio) - 1 - log_ratio).mean())
