"""The public API: the names ``gymserve`` exports and its one version."""

from __future__ import annotations

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

PUBLIC = [
    "__version__",
    "GymserveConfig",
    "GymserveError",
    "load_config",
    "open_environments",
    "run_agent",
    "serve_policy",
    "start_background_server",
]
DEFINED_IN = {
    "GymserveConfig": "gymserve.config",
    "GymserveError": "gymserve.errors",
    "load_config": "gymserve.config",
    "open_environments": "gymserve.harness.envs",
    "run_agent": "gymserve.harness.agent",
    "serve_policy": "gymserve.server.embed",
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
    with pytest.raises(
        AttributeError, match="no attribute 'LocalBackend'.*run_agent, serve_policy, start_background_server"
    ):
        gymserve.LocalBackend  # noqa: B018
    assert not hasattr(gymserve, "nope")


def test_import_gymserve_loads_nothing_heavy():
    """``import gymserve`` (and so the CLI's start) imports no web stack, SDK, torch or submodule."""
    code = (
        "import sys, gymserve; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'starlette', 'openai', 'torch', 'transformers', 'gymserve')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['gymserve', 'gymserve._version']"


# ------------------------------------------------------------------------------------------ version
def test_version_has_one_source():
    """pyproject.toml reads the version from ``gymserve._version`` (what ``gymserve.__version__`` is)
    rather than stating its own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gymserve._version.__version__"}
    assert gymserve.__version__ is gymserve._version.__version__
    assert str(Version(gymserve.__version__)) == gymserve.__version__  # PEP 440, normalized


def test_cli_prints_the_version():
    out = subprocess.run(
        [sys.executable, "-m", "gymserve.cli", "--version"], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout == f"gymserve {gymserve.__version__}\n"


def test_server_reports_the_version_in_its_openapi_document():
    # Nothing is sent upstream: the OpenAPI document is the server's own.
    cfg = validate_config(
        {"server": {"port": 0}, "backend": {"type": "chat", "base_urls": ["http://127.0.0.1:9/v1"], "model": "policy"}}
    )
    with start_background_server(cfg) as srv:
        doc = httpx.get(srv.base_url.removesuffix("/v1") + "/openapi.json", timeout=10).json()
    assert doc["info"]["version"] == gymserve.__version__
