"""The public API: the names ``gymserve`` exports, its one version, and the core/harness split."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.version import Version

import gymserve
from gymserve.config import validate_config
from gymserve.server.run import start_background_server

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "gymserve"

PUBLIC = ["__version__", "GymserveConfig", "GymserveError", "load_config", "open_environments", "run_agent",
          "start_background_server"]
DEFINED_IN = {
    "GymserveConfig": "gymserve.config",
    "GymserveError": "gymserve.errors",
    "load_config": "gymserve.config",
    "open_environments": "gymserve.harness.envs",
    "run_agent": "gymserve.harness.agent",
    "start_background_server": "gymserve.server.run",
}


def test_exported_names_are_pinned():
    """Adding or dropping a public name is a deliberate change: update PUBLIC and the docs."""
    assert gymserve.__all__ == PUBLIC
    assert sorted(dir(gymserve)) == sorted(PUBLIC)


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_each_name_is_the_defining_modules_object(name):
    assert getattr(gymserve, name) is getattr(importlib.import_module(DEFINED_IN[name]), name)


def test_unknown_name_is_an_attribute_error_listing_the_public_names():
    with pytest.raises(AttributeError, match="no attribute 'LocalBackend'.*run_agent, start_background_server"):
        gymserve.LocalBackend  # noqa: B018
    assert not hasattr(gymserve, "nope")


def test_import_gymserve_loads_nothing_heavy():
    """``import gymserve`` (and so the CLI's start) imports no web stack, SDK, torch or submodule."""
    code = ("import sys, gymserve; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('fastapi', 'starlette', 'openai', 'torch', 'transformers', 'gymserve')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['gymserve']"


# ------------------------------------------------------------------------------------------ version
def test_version_has_one_source():
    """pyproject.toml reads the version from ``gymserve.__version__`` rather than stating its own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gymserve.__version__"}
    assert str(Version(gymserve.__version__)) == gymserve.__version__  # PEP 440, normalized


def test_cli_prints_the_version():
    out = subprocess.run([sys.executable, "-m", "gymserve.cli", "--version"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout == f"gymserve {gymserve.__version__}\n"


def test_server_reports_the_version_in_its_openapi_document():
    # Nothing is sent upstream: the OpenAPI document is the server's own.
    cfg = validate_config({"server": {"port": 0}, "backend": {
        "type": "chat", "base_urls": ["http://127.0.0.1:9/v1"], "model": "policy"}})
    with start_background_server(cfg) as srv:
        doc = httpx.get(srv.base_url.removesuffix("/v1") + "/openapi.json", timeout=10).json()
    assert doc["info"]["version"] == gymserve.__version__


# ------------------------------------------------------------------------------------------- layout
def _gymserve_imports(path: Path) -> set[str]:
    """Every ``gymserve...`` module ``path`` imports, at any depth (lazy imports inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gymserve")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gymserve"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_serving_core_never_imports_the_harness():
    """The RL harness is a client of the serving core; only the CLI dispatches to it."""
    allowed = {SRC / "cli.py"}
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path in allowed or (SRC / "harness") in path.parents:
            continue
        bad = sorted(m for m in _gymserve_imports(path) if m == "gymserve.harness" or m.startswith("gymserve.harness."))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders


def test_engine_package_holds_only_engines_and_the_model_store():
    """Templating and the prefix splice sit above the engines (``gymserve.prompting``)."""
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _gymserve_imports(p) if m.startswith("gymserve.prompting"))
                 for p in sorted((SRC / "engine").rglob("*.py"))}
    assert not {k: v for k, v in offenders.items() if v}
    assert not {"template.py", "splice.py", "prompt.py"} & {p.name for p in (SRC / "engine").iterdir()}
