"""The control plane, declared once (``gymserve.control.Control``) and held by composition: no
backend declares a control verb, a backend without a control answers 501 naming itself, and the
registries have one home that the layer checker guards."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gymserve.backends.base import Backend
from gymserve.control import Control, control_of
from gymserve.errors import NotSupportedError
from gymserve.registry import BACKENDS, ENGINES, REASONING_PARSERS, ROUTING_POLICIES, TOOL_CALL_PARSERS

ROOT = Path(__file__).resolve().parents[1]
# What Control declares beyond its verbs: helpers every control shares.
NOT_VERBS = {"unsupported", "refresh", "close"}
VERBS = {n for n, v in vars(Control).items() if callable(v) and not n.startswith("_")} - NOT_VERBS


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_the_verbs_are_vllms_names():
    assert VERBS == {
        "pause_generation",
        "resume_generation",
        "is_paused",
        "update_weights",
        "update_weight_version",
        "load_lora_adapter",
        "unload_lora_adapter",
        "lora_adapters",
        "control_status",
    }


def test_no_backend_declares_a_control_verb():
    """Backend is the data path only: a control verb on a Backend class (a second implementation,
    or a forwarding layer) fails here."""
    for name in BACKENDS.names():
        BACKENDS.get(name)  # import every registered backend, so its classes are subclasses below
    for cls in [Backend, *_subclasses(Backend)]:
        for klass in cls.__mro__[:-1]:
            assert not VERBS & set(vars(klass)), f"{klass.__qualname__} declares {sorted(VERBS & set(vars(klass)))}"


def test_every_control_keeps_the_protocols_signatures():
    from gymserve.backends.chat_control import ChatControl
    from gymserve.backends.local.control import LocalControl
    from gymserve.ray_cluster.control import FleetControl

    for impl in (LocalControl, ChatControl, FleetControl):
        for verb in VERBS & set(vars(impl)):
            theirs, ours = inspect.signature(getattr(impl, verb)), inspect.signature(getattr(Control, verb))
            assert list(theirs.parameters) == list(ours.parameters), f"{impl.__name__}.{verb}{theirs} vs {ours}"


@pytest.mark.parametrize("verb", sorted(VERBS - {"lora_adapters", "control_status"}))
def test_a_backend_without_a_control_answers_501_naming_it(verb):
    control = control_of(SimpleNamespace(name="openai", control=None))
    args = {"update_weight_version": (1,), "load_lora_adapter": ("a", "/x"), "unload_lora_adapter": ("a",)}
    with pytest.raises(NotSupportedError) as exc:
        asyncio.run(getattr(control, verb)(*args.get(verb, ())))
    assert exc.value.status_code == 501 and exc.value.code == "control_not_supported"
    assert f"{verb} is not supported by the openai backend" in exc.value.message
    assert control.control_status() == [] and control.lora_adapters() == []


def test_control_of_gives_the_backends_own_control():
    mine = Control("local")
    assert control_of(SimpleNamespace(name="local", control=mine)) is mine


def test_each_registry_names_importable_implementations():
    optional = {"vllm", "trtllm"}  # GPU engines: their libraries are not installed on CPU runners
    for registry in (BACKENDS, ENGINES, TOOL_CALL_PARSERS, REASONING_PARSERS, ROUTING_POLICIES):
        for name in registry.names():
            if registry is ENGINES and name in optional:
                continue
            assert inspect.isclass(registry.get(name)), (registry.kind, name)


def _check_layers():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = module
    spec.loader.exec_module(module)
    return module


def test_the_layer_checker_refuses_a_second_registry_home_and_an_entry_naming_nothing(tmp_path):
    checker = _check_layers()
    pkg = tmp_path / "gymserve"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("from gymserve.registry import Registry\nMINE = Registry('engine')\n")
    (pkg / "registry.py").write_text(
        "class Registry:\n    def __init__(self, kind): ...\n    def register(self, name, target): ...\n"
        "E = Registry('engine')\nE.register('ok', 'gymserve.engine:Thing')\nE.register('gone', 'gymserve.nowhere:X')\n"
    )
    modules = {checker.module_name(p, tmp_path): p for p in sorted(pkg.rglob("*.py"))}
    problems = checker.check_registry(modules, tmp_path)
    assert len(problems) == 2, problems
    assert "gymserve.engine builds a Registry" in problems[0] and "'gymserve.nowhere:X' names no module" in problems[1]
    assert (
        checker.check_registry(
            {checker.module_name(p, ROOT / "src"): p for p in (ROOT / "src").rglob("*.py")}, ROOT / "src"
        )
        == []
    )
