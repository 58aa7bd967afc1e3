"""Serving a policy from inside a trainer's process: gymserve's HTTP server around a model the
trainer owns, and a handle to push new weights into it.

``serve_policy(model, tokenizer)`` is the one call (the shape of NeMo RL's in-process generation
server: ``start_server(...) → (thread, base_url, server)``): it starts the server in a daemon thread
(``server.run.start_background_server``) and returns a ``PolicyServer`` whose ``base_url`` agents
and environments use as their OpenAI base URL, whose ``stop()`` shuts it down cleanly, and whose
control methods (vLLM's names: the backend's ``gymserve.control.Control``) run on the server's event loop and block
the calling thread until done::

    server = serve_policy(model, tokenizer)             # a copy the trainer keeps for serving
    ...collect rollouts from server.base_url...
    server.update_weights(trainer_model.state_dict())   # atomic; returns the new version
    server.load_lora_adapter("policy", "adapter-dir", load_inplace=True)  # or a LoRA (PEFT format)
    server.stop()

A trainer that changes the served model object itself pauses first so no decode step sees it
half-changed: ``pause_generation("keep")``, change the weights, ``update_weight_version(v)``,
``resume_generation()``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymserve.control import Control, control_of
from gymserve.server.run import BackgroundServer

if TYPE_CHECKING:
    from gymserve.engine.base import PauseMode


@dataclass
class PolicyServer:
    """A running gymserve server over an in-process policy. ``base_url`` ends with ``/v1``;
    ``backend`` is the served ``LocalBackend`` (or the backend given). Each control method waits
    at most ``timeout`` seconds (``TimeoutError`` beyond) and raises what the backend raises
    (``WeightUpdateError`` for a refused update: the old weights keep serving)."""

    base_url: str
    backend: Any
    _server: BackgroundServer

    def _run(self, coro, timeout: float | None):
        if self._server.loop is None or not self._server.loop.is_running():
            coro.close()
            raise RuntimeError("the gymserve server is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self._server.loop).result(timeout)

    @property
    def control(self) -> Control:
        """The backend's ``gymserve.control.Control`` (``control_of``: 501s for a backend without one)."""
        return control_of(self.backend)

    @property
    def weight_version(self) -> int | str:
        """The version of the weights serving now."""
        return self.control.control_status()[0]["weight_version"]

    def update_weights(
        self,
        tensors: Mapping[str, Any] | None = None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: int | str | None = None,
        timeout: float | None = 600,
    ) -> int | str:
        """Swap in a state dict (``tensors``, name → ``torch.Tensor``; any subset) or the
        safetensors under ``path``; returns the new weight version (see ``LocalControl.update_weights``)."""
        return self._run(self.control.update_weights(tensors, path=path, weight_version=weight_version), timeout)

    def update_weight_version(self, new_version: int | str, *, timeout: float | None = 60) -> None:
        """Name the serving weights ``new_version`` (after changing the model object yourself, paused)."""
        self._run(self.control.update_weight_version(new_version), timeout)

    def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | os.PathLike | None = None,
        *,
        tensors: Mapping[str, Any] | None = None,
        config: Any = None,
        load_inplace: bool = False,
        weight_version: int | str | None = None,
        timeout: float | None = 600,
    ) -> int | str:
        """Merge a PEFT LoRA adapter — a directory, or ``tensors`` (``peft.get_peft_model_state_dict``)
        with its ``peft.LoraConfig`` — served under ``lora_name``; returns the new weight version
        (see ``engine.lora``; ``load_inplace`` swaps out the adapter loaded now)."""
        return self._run(
            self.control.load_lora_adapter(
                lora_name,
                lora_path,
                tensors=tensors,
                config=config,
                load_inplace=load_inplace,
                weight_version=weight_version,
            ),
            timeout,
        )

    def unload_lora_adapter(
        self, lora_name: str, *, weight_version: int | str | None = None, timeout: float | None = 600
    ) -> int | str:
        """Restore the base weights; returns the new weight version."""
        return self._run(self.control.unload_lora_adapter(lora_name, weight_version=weight_version), timeout)

    def pause_generation(
        self, mode: PauseMode = "abort", *, timeout: float | None = None, wait_timeout: float | None = 600
    ) -> None:
        """Pause in ``mode`` (``abort``, vLLM's default, | ``wait`` | ``keep``) for at most ``timeout``
        seconds; returns once the pause has taken effect (``wait``: the calls in flight have finished)."""
        self._run(self.control.pause_generation(mode, timeout=timeout), wait_timeout)

    def resume_generation(self, *, timeout: float | None = 60) -> None:
        """End the pause."""
        self._run(self.control.resume_generation(), timeout)

    def is_paused(self) -> bool:
        """Whether generation is paused."""
        return self._run(self.control.is_paused(), 10)

    def stop(self, timeout: float = 30) -> None:
        """Stop the server (in-flight calls get ``server.shutdown_timeout`` to finish) and close the
        backend; the engine's worker thread ends with it."""
        self._server.stop(timeout)

    def __enter__(self) -> PolicyServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_policy(
    policy: Any,
    tokenizer: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    backend_config: Any = None,
    model_name: str | None = None,
    weight_version: int | str = 0,
    startup_timeout: float = 600,
) -> PolicyServer:
    """Start gymserve's HTTP server around ``policy`` in this process; returns a ``PolicyServer``.

    ``policy``: a transformers causal LM (``torch.nn.Module`` with a ``config``: served as it is,
    on the transformers engine), a vLLM ``AsyncLLM`` or a TensorRT-LLM ``LLM`` the trainer built
    (served through ``VLLMEngine.around`` / ``TRTLLMEngine.around``, left running at ``stop()``),
    an ``Engine``, a ``Backend``, or a model directory / ``.gguf`` / ``"embedded"`` (loaded like
    ``backend.model``). ``tokenizer``: the policy's Hugging Face
    tokenizer (with its chat template); needed for a model or an engine, loaded from the model's
    ``name_or_path`` when omitted. ``backend_config``: a ``LocalBackendConfig`` or its dict
    (sampling, parsers, ``max_num_seqs``, ``pause_timeout``...). ``host``/``port``: the bind
    address (port 0: a free one); ``api_key``/``admin_api_key`` as ``server.api_key`` /
    ``server.admin_api_key``. ``model_name``: the name clients see; ``weight_version``: the
    version of the weights it starts with.

    Raises what building the backend raises (``ValueError`` for an unusable ``policy``,
    ``ConfigError`` for a bad ``backend_config``), ``TimeoutError`` after ``startup_timeout`` s.
    """
    from gymserve.backends.base import Backend
    from gymserve.config import GymserveConfig, LocalBackendConfig, validate_config
    from gymserve.server.run import start_background_server

    local = (
        backend_config
        if isinstance(backend_config, LocalBackendConfig)
        else validate_config({"backend": {"type": "local", **(backend_config or {})}}).backend
    )
    if isinstance(policy, (str, os.PathLike)):
        local = local.model_copy(update={"model": str(policy)})
    server = {"host": host, "port": port, "api_key": api_key, "admin_api_key": admin_api_key}
    config = GymserveConfig.model_validate({"server": server, "backend": local.model_dump()})

    def build() -> Backend:
        from gymserve.backends.local import LocalBackend

        if isinstance(policy, Backend):
            return policy
        if isinstance(policy, (str, os.PathLike)):
            return LocalBackend.from_config(local)
        engine = policy if _is_engine(policy) else _engine_for(policy, local, model_name, weight_version)
        return LocalBackend(local, engine, tokenizer if tokenizer is not None else _tokenizer_for(engine))

    bg = start_background_server(config, build, startup_timeout=startup_timeout)
    return PolicyServer(base_url=bg.base_url, backend=bg.backend, _server=bg)


def _is_engine(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("stream", "generate", "eos_token_ids", "context_window"))


def _engine_for(model: Any, local: Any, model_name: str | None, weight_version: int | str):
    import torch

    if hasattr(model, "generate_async") and hasattr(model, "args"):  # tensorrt_llm.LLM's API
        from gymserve.engine.trtllm_engine import TRTLLMEngine

        engine: Any = TRTLLMEngine.around(model, model_name=model_name)
    elif hasattr(model, "generate") and hasattr(model, "abort") and hasattr(model, "model_config"):  # vLLM's AsyncLLM
        from gymserve.engine.vllm_engine import VLLMEngine

        engine = VLLMEngine.around(model, model_name=model_name)
    else:
        engine = None
    if engine is not None:
        engine.pause_timeout = local.pause_timeout
        if weight_version != 0:
            engine.weight_version = weight_version
        return engine
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(
            f"serve_policy needs a transformers causal LM, a vLLM AsyncLLM, a TensorRT-LLM LLM, an Engine, a "
            f"Backend or a model path; got {type(model).__name__}"
        )
    from gymserve.engine.transformers_engine import TransformersEngine

    return TransformersEngine(
        model=model,
        model_name=model_name,
        max_batch_size=local.max_num_seqs,
        context_window=local.max_model_len,
        num_threads=local.num_threads,
        weight_version=weight_version,
        pause_timeout=local.pause_timeout,
    )


def _tokenizer_for(engine: Any):
    from transformers import AutoTokenizer

    source = getattr(getattr(getattr(engine, "model", None), "config", None), "_name_or_path", None)
    source = source or (str(engine.model_dir) if getattr(engine, "model_dir", None) else None)
    if not source:
        raise ValueError("serve_policy needs the tokenizer: pass tokenizer=AutoTokenizer.from_pretrained(...)")
    return AutoTokenizer.from_pretrained(source)
