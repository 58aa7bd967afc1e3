"""Teacher forcing per weight version: each token checked against the weights that sampled it.

A policy being trained answers from many versions; every answer says which
(``protocol.VERSION_FIELDS``: ``weight_version``, and ``weight_version_spans`` when one generation
spans an update). ``gymserve verify-rollouts --weights VERSION=DIR ...`` gives the weights of each
version to check, and every generated token is teacher-forced on its own version's weights: the
token's log-prob given the whole context (prompt and the tokens before it) — what the server reports
for it, including a ``keep`` pause's tokens after an update, whose context is recomputed on the new
weights (``engine.control``).

``DIR`` is full weights (a Hugging Face model directory, as ``save_pretrained`` writes it, or
``embedded``) or a LoRA
adapter in PEFT's format (``adapter_config.json``), applied to ``--model`` (the base) with PEFT's own
forward — what ``gymserve train-demo`` writes per step (``step-N``). One version's model is in
memory at a time. With ``--engine llamacpp`` the versions are scored on llama.cpp, as that engine
served them: full weights are a GGUF file (or a directory holding one), and a PEFT adapter is
written as a GGUF LoRA adapter (``engine.gguf_lora``) and applied unmerged to the base GGUF, as the
engine applies it.

Tokens that cannot be checked are counted and named with the reason: the answer says no version
(a server that does not report one), or the version has no ``--weights`` entry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gymserve.harness.verify import (
    RolloutCheck,
    VerifyReport,
    each_rollout,
    load_model,
    teacher_forced_log_probs,
)
from gymserve.protocol import TokenInfo, get_token_info


def parse_weights(specs: Sequence[str]) -> dict[Any, str]:
    """``["VERSION=DIR", ...]`` → ``{version: DIR}``; a version that reads as an integer is one
    (gymserve's own versions are ints). Raises ``ValueError`` naming a malformed spec or a
    directory that does not exist."""
    out: dict[Any, str] = {}
    for spec in specs:
        version, sep, path = spec.partition("=")
        if not sep or not version or not path:
            raise ValueError(f"--weights {spec!r}: expected VERSION=DIR, e.g. --weights 3=checkpoints/step-3")
        if path != "embedded" and not Path(path).is_dir() and not path.endswith(".gguf"):
            raise ValueError(f"--weights {spec!r}: {path} is not a directory, a .gguf file or 'embedded'")
        if path.endswith(".gguf") and not Path(path).is_file():
            raise ValueError(f"--weights {spec!r}: {path} does not exist")
        key: Any = int(version) if version.lstrip("-").isdigit() else version
        out[key] = path
    return out


def load_version(path: str | os.PathLike, base: str | None, engine: str = "transformers") -> Any:
    """The model of one version on ``engine``: ``path``'s full weights, or its PEFT LoRA adapter on
    ``base`` (``verify.load_model``'s kinds). Raises ``WeightUpdateError`` for an adapter the
    llamacpp engine cannot serve, naming the tensor."""
    is_adapter = (Path(path) / "adapter_config.json").is_file()
    if engine == "llamacpp" and is_adapter:
        return _llamacpp_adapter_scorer(path, base)
    if engine != "transformers":
        return load_model(path, engine)
    if is_adapter:
        from peft import PeftModel

        from gymserve.engine.hf_models import MODEL_LOAD_LOCK

        with MODEL_LOAD_LOCK:
            model = PeftModel.from_pretrained(load_model(base), str(path))
        model.eval()
        return model
    return load_model(path)


def _llamacpp_adapter_scorer(adapter: str | os.PathLike, base: str | None) -> Any:
    """A ``LlamaCppScorer`` over ``base``'s GGUF with the PEFT adapter applied as llama.cpp applies it."""
    import tempfile

    from gymserve.engine.gguf_lora import write_gguf_lora
    from gymserve.engine.gguf_store import gguf_file
    from gymserve.engine.llamacpp_runtime import LlamaCppScorer, LlamaLora

    scorer = LlamaCppScorer(gguf_file(base))
    with tempfile.TemporaryDirectory(prefix="gymserve-verify-lora-") as tmp:
        out = write_gguf_lora(adapter, Path(tmp) / "adapter.gguf", architecture=str(scorer.model.architecture))
        scorer.lora = LlamaLora(scorer.model, out)  # llama.cpp copies the adapter's tensors: the file may go
    return scorer


def token_versions(turn: Mapping[str, Any], count: int) -> list[Any]:
    """The version of each of a turn's ``count`` generated tokens (None: not reported)."""
    spans = turn.get("weight_version_spans")
    if spans:
        out: list[Any] = [None] * count
        for s in spans:
            for k in range(max(0, s["start"]), min(count, s["end"])):
                out[k] = s["version"]
        return out
    return [turn.get("weight_version")] * count


def _turn_dicts(rollout: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Where each model call's token and version fields are: the ``turns`` entries, else the
    output items that carry token fields (as ``verify.rollout_turns`` reads them)."""
    if "turns" in rollout:
        return list(rollout["turns"])
    return [item for item in rollout.get("output", []) if get_token_info(item) is not None]


def verify_by_version(
    rollouts: Sequence[dict[str, Any]],
    weights: Mapping[Any, str],
    *,
    base: str | None = None,
    tolerance: float,
    engine: str = "transformers",
) -> VerifyReport:
    """Contiguity of every rollout and each token's log-prob on its version's weights, scored on
    ``engine`` (see the module docstring); ``RolloutCheck.unchecked`` names the turns left out and why."""
    report = VerifyReport(tolerance=tolerance, teacher_forced=True)
    work: dict[Any, list[tuple[RolloutCheck, TokenInfo, list[int]]]] = {}
    diffs: dict[int, list[float]] = {}
    for r, turns, check in each_rollout(rollouts, report):
        for t, (raw, info) in enumerate(zip(_turn_dicts(r), turns)):
            if info is None:
                continue
            by_version: dict[Any, list[int]] = {}
            for k, v in enumerate(token_versions(raw, len(info["generation_token_ids"]))):
                by_version.setdefault(v, []).append(k)
            for v, positions in by_version.items():
                if v is None:
                    check.unchecked.append(f"turn {t}: {len(positions)} tokens say no weight_version")
                elif v not in weights:
                    check.unchecked.append(
                        f"turn {t}: {len(positions)} tokens of version {v!r}, which has no --weights"
                    )
                else:
                    work.setdefault(v, []).append((check, info, positions))
    for v, items in work.items():
        model = load_version(weights[v], base, engine)
        for check, info, positions in items:
            got = teacher_forced_log_probs(model, info["prompt_token_ids"], info["generation_token_ids"])
            reported = info["generation_log_probs"]
            diffs.setdefault(id(check), []).extend(abs(got[k] - reported[k]) for k in positions)
        del model
    for check in report.checks:
        mine = diffs.get(id(check))
        if mine is not None:
            check.num_tokens, check.max_diff = len(mine), max(mine) if mine else 0.0
    return report
