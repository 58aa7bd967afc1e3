"""The control plane of the local backend: its engine's pause/resume and weight updates, and the
weight-version fields of every answer it gives.

The operations are the engine's own (``engine.base.Engine``; vLLM's names), so the backend adds
only what a server needs around them: one replica named ``local`` in ``control_status``, and
``version_fields`` for the training fields of each chat message and Responses item.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gymserve.engine.base import Engine, Generation, PauseMode, WeightVersion

REPLICA = "local"


class LocalControl:
    """Mixed into ``LocalBackend`` (which sets ``self.engine``): the ``Backend`` control methods,
    delegated to the engine. See ``Engine`` for what each does and raises."""

    engine: Engine

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

    def control_status(self) -> list[dict[str, Any]]:
        return [{"replica": REPLICA, **self.engine.control_status()}]


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
