"""Check rollouts for training: token contiguity across turns, and log-probs by teacher forcing.

**Contiguity.** A multi-turn rollout is token-contiguous when, for every turn k ≥ 1, turn k's
``prompt_token_ids`` start with turn k-1's ``prompt_token_ids + generation_token_ids``. Turns are
read from a rollout's ``"turns"`` list (the ``gymserve rollout`` format, see ``gymserve.harness.rollout``),
or, when absent, from the output items that carry the training fields. A rollout without token
fields is not contiguous (reason ``"no token fields"``): it cannot be trained on token-exactly.

**Per version.** A policy being trained answers from many weight versions; with ``--weights
VERSION=DIR`` each token is checked on its own version's weights instead (``verify_versions``).

**Teacher forcing.** One forward pass of the same model over ``prompt + generation`` in float32;
``log_softmax`` of the logits at the position before each generated token gives that token's
log-prob. It must match the ``generation_log_probs`` the server reported within a tolerance
(default 1e-4). For a contiguous rollout one pass over the last turn's sequence covers all turns
(causal attention: a position's logits depend only on the tokens before it).

The model is the engine's: a transformers causal LM for the transformers engine, or a scorer — any
object with ``token_log_probs(ids, start) -> list[float]`` — such as the llamacpp engine's
``LlamaCppScorer`` (prefill passes of llama.cpp over the same GGUF file; ``--engine llamacpp``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gymserve.protocol import TokenInfo, get_token_info

DEFAULT_TOLERANCE = 1e-4
QUANTIZED_TOLERANCE = 0.5
"""The tolerance for quantized GGUF weights on llama.cpp, whose kernels quantize each layer's input
to 8 bits in a way that depends on the batch shape (one token per decode step vs a prefill pass),
so generation and teacher forcing differ by more than rounding: measured up to 0.38 on the 0.5B
embedded model (8 streams) and 0.13 on the 1.5B (mean ~0.01), far below the whole nats a wrong token or a
broken splice moves a log-prob by (docs/model-servers/llamacpp-engine.md, "Log-probs and teacher
forcing")."""


# ---------------------------------------------------------------------------------------------
# Contiguity


def rollout_turns(rollout: dict[str, Any]) -> list[TokenInfo | None]:
    """The training fields of each model call of a rollout, in order (None: a turn without them).

    Raises ``gymserve.errors.InvalidRequestError`` on partial or inconsistent token fields.
    """
    if "turns" in rollout:
        return [get_token_info(t) for t in rollout["turns"]]
    return [info for item in rollout.get("output", []) if (info := get_token_info(item)) is not None]


@dataclass
class Contiguity:
    """``ok``; otherwise ``turn`` (the first bad turn's index) and ``reason``."""

    ok: bool
    turn: int | None = None
    reason: str | None = None


def check_contiguity(turns: Sequence[TokenInfo | None]) -> Contiguity:
    """Check that each turn's prompt starts with the previous turn's prompt + generation."""
    if not turns or any(t is None for t in turns):
        bad = next((i for i, t in enumerate(turns) if t is None), None)
        return Contiguity(False, bad, "no token fields")
    infos = [t for t in turns if t is not None]  # all of them (checked above), typed without None
    for k in range(1, len(infos)):
        prev = infos[k - 1]["prompt_token_ids"] + infos[k - 1]["generation_token_ids"]
        prompt = infos[k]["prompt_token_ids"]
        if prompt[: len(prev)] != prev:
            if len(prompt) < len(prev):
                why = f"prompt has {len(prompt)} tokens, fewer than the previous prompt + generation ({len(prev)})"
            else:
                first = next(i for i, (a, b) in enumerate(zip(prompt, prev)) if a != b)
                why = f"first differing token at position {first}: {prompt[first]} != {prev[first]}"
            return Contiguity(False, k, why)
    return Contiguity(True)


# ---------------------------------------------------------------------------------------------
# Teacher forcing


def load_model(spec: str | os.PathLike | None, engine: str = "transformers"):
    """The teacher-forcing model of ``engine`` for ``spec`` (``None``/"embedded", an embedded model's
    name, a directory or a .gguf): for ``transformers`` a float32 causal LM in eval mode, resolved by
    ``gymserve.engine.model_store.resolve_model`` and loaded by ``hf_models.load_causal_lm`` (model
    loads take turns); for ``llamacpp`` a ``LlamaCppScorer`` over the GGUF file
    ``gguf_store.gguf_file`` finds. Raises ``ValueError`` for another engine."""
    if engine == "llamacpp":
        from gymserve.engine.gguf_store import gguf_file
        from gymserve.engine.llamacpp_runtime import LlamaCppScorer

        return LlamaCppScorer(gguf_file(None if spec is None else str(spec)))
    if engine != "transformers":
        raise ValueError(f"teacher forcing runs on the transformers or llamacpp engine, not {engine!r}")
    from gymserve.engine.hf_models import load_causal_lm
    from gymserve.engine.model_store import resolve_model

    resolved = resolve_model(None if spec is None else str(spec))
    model = load_causal_lm(resolved.path)
    model.eval()
    return model


def tolerance_for(model: Any) -> tuple[float, str]:
    """The tolerance log-probs teacher-forced on ``model`` are checked at, and why in one line:
    ``QUANTIZED_TOLERANCE`` when it runs quantized weights (a ``LlamaCppScorer`` whose
    ``quantized`` is true), else ``DEFAULT_TOLERANCE`` (float32 weights: the same kernels, float
    rounding apart)."""
    if getattr(model, "quantized", False) is True:
        desc = getattr(getattr(model, "model", None), "description", "") or "quantized"
        return QUANTIZED_TOLERANCE, (
            f"quantized weights ({desc}) on llama.cpp, whose kernels round differently in one-token decode "
            "steps and in teacher forcing's prefill (docs/model-servers/llamacpp-engine.md); "
            "--engine transformers checks to 1e-4"
        )
    return DEFAULT_TOLERANCE, "unquantized weights: generation and teacher forcing differ only by float rounding"


def _token_log_probs(model: Any, ids: Sequence[int], start: int) -> list[float]:
    """Log-probs (``len(ids) - start`` floats) of ``ids[start:]``, each given all tokens before it,
    from one forward pass over ``ids`` (a scorer's ``token_log_probs``). Requires ``start >= 1``."""
    if start < 1:
        raise ValueError("teacher forcing needs at least one prompt token")
    if hasattr(model, "token_log_probs"):
        return model.token_log_probs(ids, start)
    import torch

    n_keep = len(ids) - start
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        try:
            # Logits only where needed: the full [seq, vocab] matrix is GBs for long rollouts.
            logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=n_keep + 1).logits[0]
            logits = logits[:-1]  # the last position predicts a token beyond the sequence
        except TypeError:  # models without logits_to_keep
            logits = model(input_ids=input_ids, use_cache=False).logits[0, start - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = input_ids[0, start:]
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu().tolist()


def teacher_forced_log_probs(model: Any, prompt_ids: Sequence[int], generation_ids: Sequence[int]) -> list[float]:
    """Natural-log probability of each generated token given the prompt and the tokens before it.

    ``model``: a transformers causal LM (``model(input_ids).logits``: ``[1, seq, vocab]``) or a
    scorer (``token_log_probs``, see the module docstring).
    One forward pass over ``prompt_ids + generation_ids`` (shape ``[1, P + G]``); float32
    ``log_softmax`` at positions ``P-1 … P+G-2``, gathered at the generated IDs. Returns ``G`` floats
    (``[]`` when ``G == 0``). Raises ``ValueError`` on an empty prompt.
    """
    if not generation_ids:
        return []
    return _token_log_probs(model, list(prompt_ids) + list(generation_ids), len(prompt_ids))


def rollout_log_prob_diffs(model: Any, turns: Sequence[TokenInfo], contiguous: bool) -> list[float]:
    """``|recomputed - reported|`` for every generated token of the rollout's turns, turn by turn."""
    diffs: list[float] = []
    if contiguous and len(turns) > 1:
        last = turns[-1]
        seq = last["prompt_token_ids"] + last["generation_token_ids"]
        first = len(turns[0]["prompt_token_ids"])
        logp = _token_log_probs(model, seq, first)
        for t in turns:
            p, g = len(t["prompt_token_ids"]), len(t["generation_token_ids"])
            got = logp[p - first : p - first + g]
            diffs += [abs(a - b) for a, b in zip(got, t["generation_log_probs"])]
        return diffs
    for t in turns:
        got = teacher_forced_log_probs(model, t["prompt_token_ids"], t["generation_token_ids"])
        diffs += [abs(a - b) for a, b in zip(got, t["generation_log_probs"])]
    return diffs


# ---------------------------------------------------------------------------------------------
# Whole files


@dataclass
class RolloutCheck:
    """One rollout's verdict; ``max_diff`` is None when log-probs were not recomputed;
    ``unchecked``: turns whose tokens could not be teacher-forced, each with why
    (``verify_versions``: no version reported, no weights given for it)."""

    id: str
    contiguity: Contiguity
    num_tokens: int = 0
    max_diff: float | None = None
    error: str | None = None
    unchecked: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    """All rollouts: ``contiguous``/``total`` and the max log-prob difference over ``num_tokens``."""

    checks: list[RolloutCheck] = field(default_factory=list)
    tolerance: float = DEFAULT_TOLERANCE
    teacher_forced: bool = False

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def contiguous(self) -> int:
        return sum(c.contiguity.ok for c in self.checks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.checks)

    @property
    def max_diff(self) -> float | None:
        diffs = [c.max_diff for c in self.checks if c.max_diff is not None]
        return max(diffs) if diffs else None

    @property
    def contiguity_ok(self) -> bool:
        return self.total > 0 and self.contiguous == self.total

    @property
    def log_probs_ok(self) -> bool:
        return self.max_diff is None or self.max_diff <= self.tolerance

    @property
    def ok(self) -> bool:
        return self.contiguity_ok and self.log_probs_ok and not any(c.error for c in self.checks)


def load_rollouts(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a rollouts JSON Lines file (``gymserve rollout`` output). Raises ``ValueError`` naming
    the line of invalid JSON."""
    rollouts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rollouts.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc})") from exc
    return rollouts


def each_rollout(
    rollouts: Sequence[dict[str, Any]], report: VerifyReport
) -> Iterator[tuple[dict[str, Any], list[TokenInfo | None], RolloutCheck]]:
    """``(rollout, its turns' token fields, its RolloutCheck)`` for every rollout with model calls,
    the check (contiguity done) added to ``report``. Rollouts whose ``turns`` list is empty (an
    error before the first model call) are skipped; one with inconsistent token fields gets a failed
    check naming why, and is not yielded."""
    for n, r in enumerate(rollouts):
        rid = str(r.get("id", f"#{n + 1}"))
        if "turns" in r and not r["turns"]:
            continue
        try:
            turns = rollout_turns(r)
        except Exception as exc:  # noqa: BLE001 - inconsistent fields are a finding, not a crash
            report.checks.append(RolloutCheck(rid, Contiguity(False, None, str(exc)), error=str(exc)))
            continue
        check = RolloutCheck(rid, check_contiguity(turns))
        report.checks.append(check)
        yield r, turns, check


def verify_rollouts(
    rollouts: Sequence[dict[str, Any]], model: Any | None = None, *, tolerance: float = DEFAULT_TOLERANCE
) -> VerifyReport:
    """Check contiguity of every rollout and, when ``model`` is given, its log-probs.

    Rollouts whose ``turns`` list is empty (an error before the first model call) are skipped.
    """
    report = VerifyReport(tolerance=tolerance, teacher_forced=model is not None)
    for _r, turns, check in each_rollout(rollouts, report):
        infos = [t for t in turns if t is not None]
        if model is not None and infos and len(infos) == len(turns):  # every turn has token fields
            diffs = rollout_log_prob_diffs(model, infos, check.contiguity.ok)
            check.num_tokens = len(diffs)
            check.max_diff = max(diffs) if diffs else 0.0
    return report


def format_report(report: VerifyReport, *, max_listed: int = 10) -> str:
    """Human-readable summary: contiguity share, max log-prob difference, the first failures."""
    lines = []
    if report.total == 0:
        lines.append("no rollouts with model calls to check")
        return "\n".join(lines)
    share = 100.0 * report.contiguous / report.total
    lines.append(
        f"contiguity: {report.contiguous}/{report.total} rollouts token-contiguous ({share:.1f}%)"
        + ("" if report.contiguity_ok else "  FAIL")
    )
    if report.teacher_forced:
        md = report.max_diff
        md_s = "n/a (no generated tokens)" if md is None else f"{md:.3g}"
        lines.append(
            f"log-probs: {report.num_tokens} tokens teacher-forced, max |diff| = {md_s} "
            f"(tolerance {report.tolerance:g})" + ("" if report.log_probs_ok else "  FAIL")
        )
    else:
        lines.append("log-probs: not recomputed (no model given)")
    unchecked = [(c.id, why) for c in report.checks for why in c.unchecked]
    if unchecked:
        lines.append(f"not checked: {len(unchecked)} turns (their tokens are not in the log-prob verdict):")
        lines += [f"  {rid}: {why}" for rid, why in unchecked[:max_listed]]
        if len(unchecked) > max_listed:
            lines.append(f"  ... and {len(unchecked) - max_listed} more")
    bad = [
        c
        for c in report.checks
        if not c.contiguity.ok or c.error or (c.max_diff is not None and c.max_diff > report.tolerance)
    ]
    for c in bad[:max_listed]:
        parts = []
        if not c.contiguity.ok:
            parts.append(f"not contiguous at turn {c.contiguity.turn}: {c.contiguity.reason}")
        if c.max_diff is not None and c.max_diff > report.tolerance:
            parts.append(f"log-prob diff {c.max_diff:.3g}")
        lines.append(f"  {c.id}: " + "; ".join(parts))
    if len(bad) > max_listed:
        lines.append(f"  ... and {len(bad) - max_listed} more")
    return "\n".join(lines)


def main_verify(
    path: str,
    model: str | None = None,
    tolerance: float | None = None,
    weights: Sequence[str] = (),
    engine: str = "transformers",
) -> int:
    """``gymserve verify-rollouts``: exit 0 when every rollout is contiguous and every checked
    log-prob is within ``tolerance``; 1 when either fails; 2 when the file, a model or a
    ``--weights`` spec cannot be read. ``model``: the policy the rollouts came from (default: the
    embedded model). ``engine``: the engine that served them (``transformers`` or ``llamacpp``),
    which recomputes them on its own kernels. ``weights``: ``VERSION=DIR`` specs: each token is then
    checked on the weights of its own version (``verify_versions``; a LoRA adapter DIR applies to
    ``model``), and turns of versions without weights are listed as not checked. ``tolerance``
    None: ``tolerance_for`` the teacher-forcing model (with ``weights``: 1e-4, or
    ``QUANTIZED_TOLERANCE`` on llamacpp), printed with its reason."""
    try:
        rollouts = load_rollouts(path)
    except (OSError, ValueError) as exc:
        print(f"gymserve verify-rollouts: {exc}", file=sys.stderr)
        return 2
    if weights:
        from gymserve.harness.verify_versions import parse_weights, verify_by_version

        try:
            by_version = parse_weights(weights)
            print(
                f"teacher forcing each token on its version's weights on the {engine} engine: "
                f"{', '.join(map(repr, by_version))}",
                file=sys.stderr,
            )
            if tolerance is None:
                tolerance = QUANTIZED_TOLERANCE if engine == "llamacpp" else DEFAULT_TOLERANCE
                print(f"tolerance {tolerance:g} (pass --tolerance to change it)", file=sys.stderr)
            report = verify_by_version(rollouts, by_version, base=model, tolerance=tolerance, engine=engine)
        except (OSError, ValueError) as exc:
            print(f"gymserve verify-rollouts: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            print(
                f"teacher forcing with model {model or 'embedded'} on the {engine} engine (pass --model, "
                "--engine for others)",
                file=sys.stderr,
            )
            lm = load_model(model, engine)
        except Exception as exc:  # noqa: BLE001
            print(f"gymserve verify-rollouts: cannot load model {model or 'embedded'}: {exc}", file=sys.stderr)
            return 2
        if tolerance is None:
            tolerance, why = tolerance_for(lm)
            print(f"tolerance {tolerance:g}: {why}", file=sys.stderr)
        report = verify_rollouts(rollouts, lm, tolerance=tolerance)
    print(format_report(report))
    print("PASS" if report.ok else "FAIL")
    return 0 if report.ok else 1
