"""Inference engines behind one interface (``engine.base.Engine``), created from config.

``ENGINES`` (``gymserve.registry``, re-exported here) names every engine; each entry is imported
lazily so installing gymserve without an engine's package works, and asking for a missing one says
which package to install. A new engine is one module with a class that has
``from_config(config, resolved)`` and one ``ENGINES.register`` line in ``gymserve/registry.py``.
"""

from __future__ import annotations

from gymserve.engine.base import Engine, Generation, SamplingParams, TokenDelta
from gymserve.registry import ENGINES

__all__ = [
    "ENGINES",
    "Engine",
    "Generation",
    "SamplingParams",
    "TokenDelta",
    "create_engine",
    "load_engine_tokenizer",
    "resolve_engine_model",
]


def create_engine(config, resolved) -> Engine:
    """Build the engine named by ``config.engine`` for ``resolved`` (a ``model_store.ResolvedModel``).

    ``config`` is a ``LocalBackendConfig``. Engines: ``ENGINES.names()`` — ``transformers`` (CPU, the
    default), ``llamacpp`` (CPU, GGUF weights), ``vllm`` and ``trtllm`` (GPU); ``config.engine_args``
    holds the llamacpp, vllm and trtllm engine arguments.
    Raises ``registry.UnknownNameError`` (a ``ValueError``) naming the choices for an unknown engine,
    and ``ImportError`` naming the package to install when the engine's library is missing.
    """
    return ENGINES.get(config.engine).from_config(config, resolved)


def load_engine_tokenizer(config, resolved):
    """The tokenizer of ``resolved`` (a ``ResolvedModel``) as ``config.engine`` loads it: the
    engine's ``load_tokenizer(path)`` when it has one (``llamacpp``: without importing torch), else
    ``AutoTokenizer.from_pretrained(path)``."""
    loader = getattr(ENGINES.get(config.engine), "load_tokenizer", None)
    if loader is not None:
        return loader(resolved.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolved.path))


def resolve_engine_model(config):
    """``config.model`` resolved the way ``config.engine`` loads it: a GGUF file for engines with a
    ``resolve_model`` classmethod (``llamacpp``), else ``model_store.resolve_model``'s directory."""
    from gymserve.engine.model_store import resolve_model

    resolver = getattr(ENGINES.get(config.engine), "resolve_model", None) or resolve_model
    return resolver(config.model)
