"""Weight updates for a PyTorch model served in this process: read, validate, then apply.

Sources (``load_update``):

- a path: a directory in Hugging Face layout — ``model.safetensors``, the shards a
  ``model.safetensors.index.json`` lists in its ``weight_map``, or else every ``*.safetensors`` file
  in it — or one ``.safetensors`` file. Tensor names are the model's ``state_dict()`` names, as
  ``save_pretrained`` writes them.
- a state dict handed over in process: ``{name: torch.Tensor}`` (a trainer's ``model.state_dict()``
  or any part of it).

Either may hold every tensor or a subset; tensors it does not name keep their values.

Validation happens before anything changes, against the served model (``plan_update``): every name
must be one of the model's state-dict names (close matches are suggested), shape and dtype must equal
the served tensor's (no silent casts: a bf16 tensor for an fp32 model is refused), values must be
finite, and tied tensors (``lm_head.weight`` and ``model.embed_tokens.weight`` share storage when
``tie_word_embeddings`` is set) given twice must be equal. Every problem found is reported at once in
one ``WeightUpdateError`` whose ``param`` names the first tensor (or file). ``apply_plan`` then copies
the tensors in place; the engine runs it on its worker thread between two decode steps.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gymserve.errors import WeightUpdateError

MAX_LISTED = 10
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files an update from ``path`` reads, in order (see module docstring).

    Raises ``WeightUpdateError`` naming ``path`` when it does not exist, holds no safetensors, or
    its index is unreadable or lists a missing shard."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise WeightUpdateError(
                f"{p}: not a .safetensors file; give a directory in Hugging Face layout or a .safetensors file",
                param=str(p),
            )
        return [p]
    if not p.is_dir():
        raise WeightUpdateError(
            f"{p}: no such file or directory (the path is read by the server, so it must "
            "exist on the server's machine)",
            param=str(p),
        )
    index = p / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightUpdateError(
                f"{index}: unreadable index ({type(exc).__name__}: {exc}); it must be JSON "
                'with a "weight_map" object, as save_pretrained writes it',
                param=str(index),
            ) from None
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise WeightUpdateError(f"{index} lists shard {missing[0]}, which is not in {p}", param=str(p / missing[0]))
        return [p / s for s in shards]
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(
            f"{p}: no .safetensors files in the directory (save them with "
            "model.save_pretrained(dir) or safetensors.torch.save_file)",
            param=str(p),
        )
    return files


def read_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor under ``path`` (see ``safetensors_files``) as ``{name: torch.Tensor}`` on CPU.

    Raises ``WeightUpdateError`` naming the file for an unreadable or corrupt file and for a tensor
    name found in two files."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    where: dict[str, Path] = {}
    for f in safetensors_files(path):
        try:
            part = load_file(str(f))
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...: the file is the cause
            raise WeightUpdateError(
                f"{f}: cannot read safetensors file ({type(exc).__name__}: {exc})", param=str(f)
            ) from None
        for name, t in part.items():
            if name in where:
                raise WeightUpdateError(f"tensor {name!r} is in both {where[name]} and {f}", param=name)
            where[name] = f
            tensors[name] = t
    return tensors


def plan_update(model: Any, tensors: Mapping[str, Any], *, source: str = "the update") -> list[tuple[Any, Any]]:
    """Check ``tensors`` against ``model``'s state dict; ``[(served, new), ...]`` to copy.

    ``model``: a ``torch.nn.Module``; ``tensors``: name → ``torch.Tensor``; ``source`` names where
    they came from in messages. Nothing is modified. Raises ``WeightUpdateError`` listing every
    unknown name, shape, dtype, non-finite or tied-tensor conflict (see module docstring).
    """
    import torch

    if not isinstance(tensors, Mapping):
        raise WeightUpdateError(
            f"{source} must be a mapping of tensor names to tensors (a state dict), got {type(tensors).__name__}"
        )
    if not tensors:
        raise WeightUpdateError(f"{source} holds no tensors; nothing would change")
    served = model.state_dict()
    problems: list[tuple[str, str]] = []
    plan = []
    for name, new in tensors.items():
        if not isinstance(name, str) or name not in served:
            close = difflib.get_close_matches(str(name), list(served), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append((str(name), f"tensor {name!r}: unknown name, the served model has no such tensor{hint}"))
            continue
        old = served[name]
        if not isinstance(new, torch.Tensor):
            problems.append((name, f"tensor {name!r}: is a {type(new).__name__}, not a torch.Tensor"))
        elif tuple(new.shape) != tuple(old.shape):
            problems.append(
                (name, f"tensor {name!r}: shape {list(new.shape)}, the served model's is {list(old.shape)}")
            )
        elif new.dtype != old.dtype:
            problems.append(
                (
                    name,
                    f"tensor {name!r}: dtype {new.dtype}, the served model's is {old.dtype}; cast it "
                    f"(tensor.to({old.dtype})) before the update",
                )
            )
        elif new.is_floating_point() and (bad := _non_finite(new)):
            problems.append((name, f"tensor {name!r}: {bad} NaN or infinite values"))
        else:
            plan.append((name, old, new))
    problems += _tied_conflicts(plan)
    if problems:
        listed = "; ".join(msg for _, msg in problems[:MAX_LISTED])
        more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise WeightUpdateError(
            f"weight update refused, nothing changed ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''} in {source}): {listed}{more}",
            param=problems[0][0],
        )
    return [(old, new) for _, old, new in plan]


def _non_finite(t: Any) -> int:
    """How many elements of ``t`` are NaN or infinite. A sum is non-finite whenever an element is
    (and is one reduction at memory speed), so the element-wise count runs only then (or when a
    finite sum overflowed the dtype, e.g. float16)."""
    import torch

    if bool(torch.isfinite(t.sum())):
        return 0
    return int((~torch.isfinite(t)).sum())


def _tied_conflicts(plan: list[tuple[str, Any, Any]]) -> list[tuple[str, str]]:
    """Names given twice for one storage (tied weights) with different values."""
    import torch

    first: dict[tuple, tuple[str, Any]] = {}
    out = []
    for name, old, new in plan:
        key = (old.data_ptr(), tuple(old.shape), old.stride())  # the same view of the same memory
        if key in first:
            other, value = first[key]
            if not torch.equal(value.to(new.device), new):
                out.append(
                    (name, f"tensor {name!r}: tied to {other!r} (they share storage) but given a different value")
                )
        else:
            first[key] = (name, new)
    return out


def apply_plan(plan: list[tuple[Any, Any]]) -> None:
    """Copy each new tensor into the served one, in place (the caller makes this atomic)."""
    import torch

    with torch.no_grad():
        for old, new in plan:
            old.copy_(new)


def load_update(
    model: Any, tensors: Mapping[str, Any] | None = None, *, path: str | os.PathLike | None = None
) -> list[tuple[Any, Any]]:
    """Read (for ``path``) and validate an update: the copy plan for ``apply_plan``.

    Exactly one of ``tensors`` and ``path`` must be given. Raises ``WeightUpdateError``."""
    if (tensors is None) == (path is None):
        raise WeightUpdateError("give exactly one of tensors (a state dict) and path (a safetensors directory or file)")
    if path is not None:
        return plan_update(model, read_safetensors(path), source=str(path))
    assert tensors is not None
    return plan_update(model, tensors, source="the state dict")
