"""Inference engines behind one interface (``engine.base.Engine``), created from config.

Engines are imported lazily so that installing gymserve without an engine's package works, and
asking for a missing one says which package to install.
"""

from __future__ import annotations

from gymserve.engine.base import Engine, Generation, SamplingParams, TokenDelta

__all__ = ["Engine", "Generation", "SamplingParams", "TokenDelta", "create_engine"]


def create_engine(config, resolved) -> Engine:
    """Build the engine named by ``config.engine`` for ``resolved`` (a ``model_store.ResolvedModel``).

    Engines: ``transformers`` (CPU, the default), ``vllm`` and ``trtllm`` (GPU; ``config.engine_args``
    holds their engine arguments). Raises ``ValueError`` naming the choices for an unknown engine, and
    ``ImportError`` naming the package to install when the engine's library is missing
    (``pip install vllm``, ``pip install tensorrt_llm``).
    """
    name = config.engine
    if name == "transformers":
        try:
            from gymserve.engine.transformers_engine import TransformersEngine
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError('the transformers engine needs the local extra: pip install "gymserve[local]"') from exc
        return TransformersEngine(resolved.path, model_name=resolved.name, max_batch_size=config.max_batch_size,
                                  context_window=config.context_window, num_threads=config.num_threads)
    if name == "vllm":
        from gymserve.engine.vllm_engine import VLLMEngine  # imports vllm only when constructed

        return VLLMEngine(resolved.path, model_name=resolved.name, context_window=config.context_window,
                          engine_args=dict(getattr(config, "engine_args", None) or {}))
    if name == "trtllm":
        from gymserve.engine.trtllm_engine import TRTLLMEngine  # imports tensorrt_llm only when constructed

        return TRTLLMEngine(resolved.path, model_name=resolved.name, context_window=config.context_window,
                            engine_args=dict(getattr(config, "engine_args", None) or {}))
    raise ValueError(f"unknown engine {name!r}; choices: transformers, vllm, trtllm")
