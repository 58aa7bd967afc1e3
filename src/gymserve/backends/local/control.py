"""The control of the local backend: its engine's pause/resume, weight updates and LoRA adapters,
and the weight-version fields of every answer it gives.

The operations are the engine's own (``engine.base.Engine``; vLLM's names), so ``LocalControl``
adds only what a server needs around them: one replica named ``local`` in ``control_status``.
``version_fields`` gives the training fields of each chat message and Responses item. Which model
name a request may use while an adapter is merged is the backend's (``LocalBackend.check_model``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gymserve.control import Control
from gymserve.engine.base import Engine, Generation, PauseMode, WeightVersion

REPLICA = "local"


class LocalControl(Control):
    """``LocalBackend.control``: the ``Control`` verbs, delegated to ``engine``. See ``Engine`` for
    what each does and raises; an engine a trainer hands to ``serve_policy`` may implement only
    generation, and then answers the verbs it lacks as ``Engine``'s defaults do (501)."""

    def __init__(self, engine: Engine):
        super().__init__("local")
        self.engine = engine

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        await self.engine.pause_generation(mode, timeout=timeout)

    async def resume_generation(self) -> None:
        await self.engine.resume_generation()

    async def is_paused(self) -> bool:
        return await self.engine.is_paused()

    async def update_weights(
        self,
        tensors: Mapping[str, Any] | None = None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Swap in a state dict (``tensors``: name → ``torch.Tensor``, any subset of the served
        model's ``state_dict()``) or the safetensors under ``path``; returns the new version.
        In-flight calls continue on the new weights between two decode steps (pause first with
        ``mode="wait"`` to keep every call on one version). Raises ``WeightUpdateError`` (400)
        naming the tensor or file; the old weights then keep serving."""
        return await self.engine.update_weights(tensors, path=path, weight_version=weight_version)

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        await self.engine.update_weight_version(new_version)

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | os.PathLike | None = None,
        *,
        tensors: Mapping[str, Any] | None = None,
        config: Any = None,
        load_inplace: bool = False,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Merge a PEFT adapter (directory ``lora_path``, or ``tensors`` + ``config`` in process);
        returns the new weight version. See ``engine.lora.LoraEngine.load_lora_adapter``."""
        kwargs: dict[str, Any] = {"load_inplace": load_inplace, "weight_version": weight_version}
        if tensors is not None:
            kwargs.update(tensors=tensors, config=config)
        return await self.engine.load_lora_adapter(lora_name, None if lora_path is None else str(lora_path), **kwargs)

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Restore the base weights; returns the new weight version (404 for an adapter not loaded)."""
        return await self.engine.unload_lora_adapter(lora_name, weight_version=weight_version)

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapter(s), as ``engine.lora.LoraEngine.lora_adapters`` lists them (``[]`` for
        an engine without LoRA)."""
        loaded: list[dict[str, Any]] = getattr(self.engine, "lora_adapters", list)()
        return loaded

    def control_status(self) -> list[dict[str, Any]]:
        return [{"replica": REPLICA, **self.engine.control_status()}]

    async def close(self) -> None:
        return None  # the engine is the backend's: LocalBackend.close closes it


def version_fields(gen: Generation, engine: Any) -> dict[str, Any]:
    """``weight_version`` (the version that sampled the first token: the one the call started on)
    and, when the generation's tokens (its stop token included) came from more than one version,
    ``weight_version_spans`` over them (see ``protocol.VERSION_FIELDS``). An engine that reports no
    versions per token is asked for its current one."""
    spans = gen.weight_version_spans
    version = spans[0]["version"] if spans else getattr(engine, "weight_version", None)
    out: dict[str, Any] = {} if version is None else {"weight_version": version}
    if len(spans) > 1:
        out["weight_version_spans"] = spans
    return out
