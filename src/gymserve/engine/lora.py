"""LoRA adapters in PEFT's format, served by merging them into the weights of an in-process model.

An adapter (what ``peft.PeftModel.save_pretrained`` writes) is a directory with
``adapter_config.json`` (``peft.LoraConfig``) and ``adapter_model.safetensors``, whose tensors are
named ``base_model.model.<module>.lora_A.weight`` (``[r, in_features]``) and ``…lora_B.weight``
(``[out_features, r]``) for each adapted ``torch.nn.Linear`` ``<module>`` of the base model. Served,
the adapted layer computes ``x W^T + scale · x A^T B^T`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern``/``alpha_pattern`` override both per
module, matched as PEFT matches them) — the LoRA paper's (Hu et al., 2021, eq. 3) and PEFT's rule.

gymserve serves it exactly on CPU by merging: ``W' = W + scale · B @ A`` (computed in float32, cast
to the served dtype), handed to the engine's atomic weight update (``engine.control``), so no decode
step sees a half-merged model and each load, swap or unload is one new weight version. The base
values of every adapted tensor are kept, so unloading (or swapping to another adapter) restores them
bit for bit instead of subtracting the delta again.

One adapter at a time: merged weights serve one policy, so a second adapter while one is loaded is
refused (409) unless it replaces the first (``load_inplace``), and a full weight update while an
adapter is merged is refused too (it would mix the adapter into the new base weights); a trainer
that changes the served model object itself (``update_weight_version``) must unload first, or the
kept base values go stale. Serving several adapters in one batch needs unmerged per-row LoRA
kernels (vLLM's Punica); not here.

What cannot be merged exactly is refused before anything changes (``WeightUpdateError``, 400,
naming the tensor or the config field): DoRA, LoRA biases, ``modules_to_save``, trainable tokens,
aLoRA, LoRA on non-Linear layers or on tied tensors; so is an unknown module (with the closest
name), a rank or shape that does not fit, and NaN/inf values.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gymserve.engine.base import WeightVersion
from gymserve.errors import ConflictError, InvalidRequestError, NotFoundError, WeightUpdateError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
MAX_NAME_CHARS = 256
MAX_LISTED = 10

# LoraConfig fields whose adapters change more than W (or not per weight): merging would not be exact.
_UNMERGEABLE = {
    "use_dora": "DoRA rescales each merged column by a learned magnitude",
    "lora_bias": "a LoRA bias adds a vector to the layer output",
    "modules_to_save": "modules_to_save replaces whole modules",
    "trainable_token_indices": "trainable tokens replace embedding rows",
    "alora_invocation_tokens": "aLoRA applies only after its invocation tokens",
    "target_parameters": "target_parameters adapts raw parameters, not Linear layers",
    "layer_replication": "layer_replication duplicates layers",
    "use_qalora": "QA-LoRA pools the input",
}


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read and checked against a model: ``merged`` maps each adapted parameter's
    ``state_dict`` name (``<module>.weight``) to its new value ``W + scale · B @ A`` over the base
    values it was given (emptied once applied). ``rank``: the config's ``r``; ``source``: the path
    or ``"tensors"``; ``modules``: the adapted parameters' names."""

    name: str
    source: str
    rank: int
    merged: dict[str, Any]
    modules: tuple[str, ...] = ()


def refuse_second_adapter(current: str | None, lora_name: str, load_inplace: bool, *, serving: str) -> None:
    """The refusals of a load while adapter ``current`` serves (engines serve one at a time):
    vLLM's 400 (code ``lora_adapter_loaded``) for the same name, a 409 (``lora_slot_taken``) for
    another; nothing when none serves or ``load_inplace`` asks for a swap. ``serving`` says how
    ``current`` serves, e.g. "is merged into the weights"."""
    if current is None or load_inplace:
        return
    if current == lora_name:
        raise InvalidRequestError(
            f"The lora adapter '{lora_name}' has already been loaded; load it with "
            "load_inplace: true to replace its weights",
            param="lora_name",
            code="lora_adapter_loaded",
        )
    raise ConflictError(
        f"LoRA adapter {lora_name!r} refused: adapter {current!r} {serving}, and this engine serves one adapter "
        "at a time. Unload it first (POST /v1/unload_lora_adapter), or load with load_inplace: true to swap in "
        "one update",
        code="lora_slot_taken",
    )


def check_lora_name(name: Any, param: str = "lora_name") -> str:
    """``name`` if it is a non-empty string of at most 256 characters, else ``InvalidRequestError``."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise InvalidRequestError(
            f"{param} must be a non-empty string of at most {MAX_NAME_CHARS} characters, got {name!r}", param=param
        )
    return name


def read_adapter(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(peft.LoraConfig, {tensor name: torch.Tensor})`` of the PEFT adapter directory ``path``.

    Raises ``WeightUpdateError`` naming the file: missing directory or files, a config that is not
    JSON, not ``peft_type: LORA`` or that ``peft.LoraConfig`` refuses, unreadable safetensors."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_dir():
        raise WeightUpdateError(
            f"{p}: no such directory; a LoRA adapter is a directory with {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS}, as peft's save_pretrained writes it (the path is read by the "
            "server, so it must exist on the server's machine)",
            param=str(p),
        )
    cfg_file, weights = p / ADAPTER_CONFIG, p / ADAPTER_WEIGHTS
    for f in (cfg_file, weights):
        if not f.is_file():
            hint = (
                " (adapter_model.bin is not read: save with safe_serialization=True)"
                if f == weights and (p / "adapter_model.bin").exists()
                else ""
            )
            raise WeightUpdateError(
                f"{f}: missing; a PEFT LoRA adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}{hint}",
                param=str(f),
            )
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        peft_type = raw.get("peft_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise WeightUpdateError(
            f"{cfg_file}: not a JSON object ({type(exc).__name__}: {exc})", param=str(cfg_file)
        ) from None
    if peft_type != "LORA":
        raise WeightUpdateError(
            f'{cfg_file}: peft_type is {peft_type!r}; only LoRA adapters (peft_type "LORA") can be loaded',
            param=str(cfg_file),
        )
    try:
        config = LoraConfig.from_pretrained(str(p))
    except Exception as exc:  # noqa: BLE001 - peft raises TypeError/ValueError/...: the config is the cause
        raise WeightUpdateError(
            f"{cfg_file}: peft.LoraConfig refuses it ({type(exc).__name__}: {exc})", param=str(cfg_file)
        ) from None
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...
        raise WeightUpdateError(
            f"{weights}: cannot read safetensors file ({type(exc).__name__}: {exc})", param=str(weights)
        ) from None
    return config, tensors


def _config_problems(config: Any) -> list[tuple[str, str]]:
    problems = []
    peft_type = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    if peft_type not in (None, "LORA"):
        problems.append(("peft_type", f"config peft_type {peft_type!r}: not a LoRA adapter"))
    for name, why in _UNMERGEABLE.items():
        value = getattr(config, name, None)
        if value not in (None, False, [], {}, ()):
            problems.append((name, f"config {name}={value!r}: cannot be merged exactly ({why})"))
    if getattr(config, "bias", "none") != "none":
        problems.append(("bias", f'config bias={config.bias!r}: trained biases are not merged; use bias "none"'))
    return problems


def _rank_and_scale(config: Any, module: str) -> tuple[int, float]:
    """The module's ``r`` and ``scale``, with PEFT's pattern matching of ``rank_pattern`` keys."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = dict(config.rank_pattern or {}), dict(config.alpha_pattern or {})
    r = int(ranks.get(get_pattern_key(list(ranks), module), config.r))
    alpha = float(alphas.get(get_pattern_key(list(alphas), module), config.lora_alpha))
    return r, alpha / (math.sqrt(r) if config.use_rslora else r)


def _pairs(tensors: Mapping[str, Any], problems: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """``{module: {"A": tensor, "B": tensor}}`` from PEFT's names; other names become problems."""
    pairs: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        stem, dot, which = str(key).removesuffix(".weight").rpartition(".lora_")
        if not (
            isinstance(key, str) and key.startswith(PREFIX) and key.endswith(".weight") and dot and which in ("A", "B")
        ):
            problems.append(
                (
                    str(key),
                    f"tensor {key!r}: not a LoRA matrix (expected {PREFIX}<module>.lora_A.weight "
                    "or .lora_B.weight; biases, DoRA magnitudes, embedding LoRA and saved modules "
                    "cannot be merged)",
                )
            )
            continue
        pairs.setdefault(stem.removeprefix(PREFIX), {})[which] = (key, t)
    for module, pair in pairs.items():
        for which in ("A", "B"):
            if which not in pair:
                have = next(iter(pair.values()))[0]
                problems.append(
                    (have, f"tensor {have!r}: its lora_{which} partner {PREFIX}{module}.lora_{which}.weight is missing")
                )
    return {m: p for m, p in pairs.items() if len(p) == 2}


def _check_module(model: Any, module: str, a_key: str, linear: list[str], tied: set[str]) -> tuple[str, str] | None:
    import torch

    try:
        layer = model.get_submodule(module)
    except AttributeError:
        close = difflib.get_close_matches(module, linear, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return a_key, f"tensor {a_key!r}: unknown target module {module!r}, the served model has no such layer{hint}"
    if not isinstance(layer, torch.nn.Linear):
        return a_key, (
            f"tensor {a_key!r}: target module {module!r} is a {type(layer).__name__}; only "
            "torch.nn.Linear layers can take a merged LoRA"
        )
    if f"{module}.weight" in tied:
        return a_key, (
            f"tensor {a_key!r}: {module}.weight is tied to another tensor (tie_word_embeddings), so "
            "merging would change both; train the adapter without this module"
        )
    return None


def _check_pair(module: str, layer: Any, pair: dict[str, Any], r: int) -> list[tuple[str, str]]:
    import torch

    (a_key, a), (b_key, b) = pair["A"], pair["B"]
    out = []
    for key, t in ((a_key, a), (b_key, b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
            out.append((key, f"tensor {key!r}: must be a 2-D floating-point torch.Tensor"))
        elif not bool(torch.isfinite(t).all()):
            out.append((key, f"tensor {key!r}: {int((~torch.isfinite(t)).sum())} NaN or infinite values"))
    if out:
        return out
    want_a, want_b = [r, layer.in_features], [layer.out_features, r]
    if list(a.shape) != want_a:
        out.append(
            (
                a_key,
                f"tensor {a_key!r}: shape {list(a.shape)}, expected {want_a} (rank r={r} from the config "
                f"for {module!r} × the layer's in_features)",
            )
        )
    if list(b.shape) != want_b:
        out.append(
            (
                b_key,
                f"tensor {b_key!r}: shape {list(b.shape)}, expected {want_b} (the layer's out_features × rank r={r})",
            )
        )
    return out


def _tied_names(model: Any) -> set[str]:
    """Names of parameters that share storage with another one (``lm_head`` ↔ embeddings)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            tied.update((name, seen[p.data_ptr()]))
        seen.setdefault(p.data_ptr(), name)
    return tied


def merge_adapter(
    model: Any, name: str, config: Any, tensors: Mapping[str, Any], base: Mapping[str, Any], *, source: str = "tensors"
) -> LoraAdapter:
    """Check the adapter against ``model`` and compute its merged weights; nothing is modified.

    ``config``: a ``peft.LoraConfig``; ``tensors``: PEFT's adapter state dict (see module
    docstring); ``base``: the base values of parameters already replaced by another adapter
    (``state_dict`` name → tensor), used instead of the model's current ones. Raises
    ``WeightUpdateError`` listing every problem, ``param`` naming the first tensor or config field.
    """
    import torch

    problems = _config_problems(config)
    if not isinstance(tensors, Mapping) or not tensors:
        problems.append(("tensors", "the adapter holds no tensors"))
        tensors = {}
    pairs = _pairs(tensors, problems)
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    tied = _tied_names(model)
    state = model.state_dict()
    merged = {}
    for module, pair in pairs.items():
        bad = _check_module(model, module, pair["A"][0], linear, tied)
        if bad:
            problems.append(bad)
            continue
        r, scale = _rank_and_scale(config, module)
        layer_problems = _check_pair(module, model.get_submodule(module), pair, r)
        if layer_problems:
            problems += layer_problems
            continue
        w_name = f"{module}.weight"
        w = base.get(w_name, state[w_name])
        delta = pair["B"][1].float() @ pair["A"][1].float()
        if config.fan_in_fan_out:
            delta = delta.T
        merged[w_name] = (w.float() + scale * delta).to(w.dtype)
    if problems:
        listed = "; ".join(msg for _, msg in problems[:MAX_LISTED])
        more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise WeightUpdateError(
            f"LoRA adapter {name!r} refused, nothing changed ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''} in {source}): {listed}{more}",
            param=problems[0][0],
        )
    return LoraAdapter(name=name, source=source, rank=int(config.r), merged=merged, modules=tuple(merged))


@dataclass
class _Slot:
    """The adapter merged now (None: the base weights serve) and the base values it replaced."""

    adapter: LoraAdapter | None = None
    version: WeightVersion | None = None
    base: dict[str, Any] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LoraEngine:
    """LoRA operations (vLLM's names) for an engine whose ``update_weights`` is the atomic update of
    ``engine.control.WorkerControl`` and whose ``model`` is a ``torch.nn.Module``; mix it in before
    ``WorkerControl``. See the module docstring for what is served and refused."""

    model: Any

    @property
    def _lora(self) -> _Slot:
        slot = self.__dict__.get("_lora_slot")
        if slot is None:
            slot = self.__dict__["_lora_slot"] = _Slot()
        return slot

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The merged adapter as ``[{"name", "source", "rank", "modules", "weight_version"}]``;
        ``[]`` when the base weights serve."""
        s = self._lora
        if s.adapter is None:
            return []
        return [
            {
                "name": s.adapter.name,
                "source": s.adapter.source,
                "rank": s.adapter.rank,
                "modules": len(s.adapter.modules),
                "weight_version": s.version,
            }
        ]

    def lora_snapshot(self) -> tuple[Any, Any, dict[str, Any]]:
        """Which adapter is merged now, its version and the base values it replaced: what
        ``restore_lora_snapshot`` puts back when a fleet-wide update is undone (``engine.control.UndoLog``
        puts back the weights themselves)."""
        s = self._lora
        return s.adapter, s.version, dict(s.base)

    def restore_lora_snapshot(self, snapshot: tuple[Any, Any, dict[str, Any]]) -> None:
        """Make ``snapshot`` (``lora_snapshot``'s) the adapter state again."""
        s = self._lora
        s.adapter, s.version, s.base = snapshot[0], snapshot[1], dict(snapshot[2])

    def control_status(self) -> dict[str, Any]:
        """The control status (``engine.control``) plus ``lora_adapter``: the merged adapter's name."""
        status = super().control_status()  # type: ignore[misc]
        adapter = self._lora.adapter
        return {**status, "lora_adapter": adapter.name if adapter else None}

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | os.PathLike | None = None,
        *,
        tensors: Mapping[str, Any] | None = None,
        config: Any = None,
        load_inplace: bool = False,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Merge an adapter into the served weights; returns the new weight version.

        Give ``lora_path`` (a PEFT adapter directory) or ``tensors`` with ``config`` (PEFT's adapter
        state dict, e.g. ``peft.get_peft_model_state_dict(model)``, and its ``peft.LoraConfig``).
        ``load_inplace``: replace the adapter merged now (same or other name) in one update — a swap;
        without it a second adapter is refused. Raises ``InvalidRequestError`` (400) for a bad name
        or argument mix, an already loaded name; ``ConflictError`` (409) while another adapter is
        merged; ``WeightUpdateError`` (400) naming the tensor for a bad adapter (nothing changed).
        """
        lora_name = check_lora_name(lora_name)
        if (lora_path is None) == (tensors is None) or (tensors is not None and config is None):
            raise InvalidRequestError(
                "give lora_path (a PEFT adapter directory) or tensors together with config (its peft.LoraConfig)",
                param="lora_path",
            )
        s = self._lora
        async with s.lock:
            current = s.adapter
            refuse_second_adapter(
                current.name if current else None,
                lora_name,
                load_inplace,
                serving="is merged into the weights (it merges W + scale·B·A)",
            )
            if lora_path is not None:
                config, tensors = await asyncio.to_thread(read_adapter, lora_path)
            source = str(lora_path) if lora_path is not None else "tensors"
            assert tensors is not None
            adapter = await asyncio.to_thread(
                merge_adapter, self.model, lora_name, config, tensors, s.base, source=source
            )
            new_base = await asyncio.to_thread(self._base_values, adapter, s.base)
            update = dict(adapter.merged)
            for w_name, value in s.base.items():  # tensors the old adapter changed and this one does not
                update.setdefault(w_name, value)
            version = await self._apply_lora(update, weight_version)
            s.adapter, s.version, s.base = replace(adapter, merged={}), version, new_base  # the model holds them now
            return version

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Restore the base weights the merged adapter ``lora_name`` replaced (bit for bit); returns
        the new weight version. Raises ``NotFoundError`` (404) when that adapter is not loaded."""
        lora_name = check_lora_name(lora_name)
        s = self._lora
        async with s.lock:
            if s.adapter is None or s.adapter.name != lora_name:
                loaded = f"adapter {s.adapter.name!r} is" if s.adapter else "no adapter is"
                raise NotFoundError(
                    f"The lora adapter '{lora_name}' cannot be found: {loaded} loaded",
                    param="lora_name",
                    code="lora_adapter_not_found",
                )
            version = await self._apply_lora(dict(s.base), weight_version)
            s.adapter, s.version, s.base = None, None, {}
            return version

    def _base_values(self, adapter: LoraAdapter, base: Mapping[str, Any]) -> dict[str, Any]:
        """The base value of every tensor the adapter changes: kept ones, else a copy of the served one."""
        params = dict(self.model.named_parameters())
        return {k: base[k] if k in base else params[k].detach().clone() for k in adapter.merged}

    async def _apply_lora(self, tensors: dict[str, Any], weight_version: WeightVersion | None) -> WeightVersion:
        return await super().update_weights(tensors, weight_version=weight_version)  # type: ignore[misc]

    async def update_weights(
        self,
        tensors: Mapping[str, Any] | None = None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """``WorkerControl.update_weights``, refused (409) while a LoRA adapter is merged: the new
        tensors would overwrite merged values and the kept base values would go stale."""
        s = self._lora
        async with s.lock:  # a LoRA load between the check and the update would keep stale base values
            if s.adapter is not None:
                raise ConflictError(
                    f"weight update refused: LoRA adapter {s.adapter.name!r} is merged into the "
                    "weights. Unload it first (POST /v1/unload_lora_adapter), or push the trained "
                    "policy as an adapter (POST /v1/load_lora_adapter with load_inplace: true)",
                    code="lora_adapter_merged",
                )
            return await super().update_weights(tensors, path=path, weight_version=weight_version)  # type: ignore[misc]
