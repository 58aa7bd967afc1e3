"""gymserve: token-exact model serving for RL of LLM agents.

Most users run the ``gymserve`` command (``gymserve serve``, ``gymserve demo``, ``gymserve rollout``)
and talk to it over HTTP with the official ``openai`` SDK. From Python, the public API is what
``__all__`` names:

- ``__version__``: this release (from ``gymserve._version``, which ``pyproject.toml`` reads too);
- ``load_config`` → ``GymserveConfig``: the YAML config (``docs/reference/configuration.md``);
- ``start_background_server(config)``: serve in this process, in a thread, until ``.stop()``
  (a context manager; ``.base_url`` ends in ``/v1``);
- ``serve_policy(model, tokenizer)``: serve a policy a trainer holds, in a thread, and push new
  weights into it (``docs/concepts/training-control.md``);
- ``GymserveError``: the root of every error gymserve raises (``gymserve.errors``);
- ``run_agent`` and ``open_environments``: the RL harness's agent loop and example environments
  (``docs/tutorial.md``).

Names are imported on first use (PEP 562 module ``__getattr__``), so ``import gymserve`` and the CLI
stay fast and installing without the ``local`` extra works. Everything else is internal and may move.
"""

from __future__ import annotations

import importlib
from typing import Any

from gymserve._version import __version__

# name -> the module that defines it (the public name is the same there).
_EXPORTS = {
    "GymserveConfig": "gymserve.config",
    "GymserveError": "gymserve.errors",
    "load_config": "gymserve.config",
    "open_environments": "gymserve.harness.envs",
    "run_agent": "gymserve.harness.agent",
    "serve_policy": "gymserve.server.embed",
    "start_background_server": "gymserve.server.run",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gymserve' has no attribute {name!r}; its public names: {', '.join(__all__)}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
