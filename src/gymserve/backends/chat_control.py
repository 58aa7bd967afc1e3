"""The chat backend as a training gateway: pause at the door, forward the rest to the servers.

A trainer running its own vLLM or SGLang servers behind gymserve drives them through gymserve's
control routes (vLLM's names, ``server.control_routes``): the gateway holds the rollouts' calls while the
trainer updates its servers, so no rollout fails, and forwards what the servers can do themselves to
their own control endpoints (``upstream_control``; ``backend.upstream_control`` names the flavour).

========  =================================================  ============================================
mode      at the gateway (``engine.pause_gate``)             forwarded
========  =================================================  ============================================
abort     new calls held; calls in flight end now with what  vLLM ``/pause?mode=abort``, SGLang
          was streamed, ``finish_reason: "abort"`` (the       ``{"mode": "abort"}``: the server ends them
          servers end them themselves when forwarded to)      and they come back as its aborted answers
wait      new calls held; ``/pause`` returns once the calls   vLLM ``mode=wait``; SGLang: ``retract`` once
          in flight finished (409 ``pause_ended`` at the      they finished
          deadline)
keep      new calls held; calls in flight run on (a gateway  vLLM ``mode=keep`` (frozen, resumed later),
          cannot freeze a server's batch)                     SGLang ``retract`` (requeued, recomputed)
========  =================================================  ============================================

Held calls never fail and never get a 5xx: at most ``server.max_queue`` wait (429 beyond, as every
full queue in gymserve), and the pause ends at ``/resume`` or its deadline (``backend.pause_timeout``
unless the pause names one; the log says so). ``update_weights`` (a directory on the servers'
machine; in-process tensors cannot reach a remote server: 501), ``update_weight_version`` and the
LoRA routes are forwarded; without a flavour they answer 501 naming the operation and the setting.
The gateway names each change's version (the trainer's ``weight_version``, else its count of
changes) and ``control_status()`` reports per replica the version it last set or read
(``/health``, ``/metrics``, ``/weight_info``) and how many answers it left without a version
because a change was forwarded while they ran; every answer carries its version
(``chat_versions``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from gymserve.backends.chat_versions import ReplicaVersions
from gymserve.backends.upstream_control import UpstreamControl, control_for
from gymserve.control import Control, check_mode, check_timeout, check_version
from gymserve.engine.base import PauseMode, WeightVersion
from gymserve.engine.pause_gate import PauseGate
from gymserve.errors import ConflictError, GymserveError, NotSupportedError
from gymserve.redaction import redact_url


class ChatControl(Control):
    """``chat.ChatBackend.control``, built from its ``ChatBackendConfig``: the ``gate`` (which
    ``remote.RemoteBackend`` admits every call through), the ``upstream_control`` forwarding to the
    servers, and the ``versions`` the gateway knows of them (stamped on every answer)."""

    gate: PauseGate
    upstream_control: UpstreamControl
    versions: ReplicaVersions

    def __init__(self, config: Any, max_queue: int):
        super().__init__("chat")
        self.gate = PauseGate(name="the chat backend", default_timeout=float(config.pause_timeout), max_queue=max_queue)
        self.upstream_control = control_for(config)
        read = self.upstream_control.weight_versions if self._forwarding else None
        self.versions = ReplicaVersions(self.upstream_control.roots, read)
        self._changes = 0

    @property
    def _forwarding(self) -> bool:
        return self.upstream_control.flavour != "none"

    # ---- pause ----------------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """Pause in ``mode`` (table in the module docstring) for at most ``timeout`` s; returns once
        it took effect. Raises ``ConflictError`` (409) when a ``wait`` pause ends before the calls
        in flight finish, or the servers' error when they refuse the pause (the gateway then lets
        calls through again: no pause took effect)."""
        mode = check_mode(mode)
        timeout = None if timeout is None else check_timeout(timeout)
        await self.gate.pause(mode, timeout, abort_in_flight=not self._forwarding, drain=False)
        try:
            if mode == "wait" and self.upstream_control.flavour != "vllm":
                await self.gate.drain()  # SGLang has no wait mode; none forwards nothing
                await self.upstream_control.pause(mode)
            else:
                await self.upstream_control.pause(mode)
                if mode == "wait":
                    await self.gate.drain()
        except ConflictError:
            raise
        except GymserveError:
            self.gate.resume(reason="the servers refused the pause")
            raise

    async def resume_generation(self) -> None:
        """Resume the servers (when forwarding), then let the held calls go. The held calls go even
        when a server refuses to resume, so the rollouts are never stuck at the gateway."""
        try:
            await self.upstream_control.resume()
        finally:
            self.gate.resume()

    async def is_paused(self) -> bool:
        return self.gate.paused is not None

    # ---- weight changes -------------------------------------------------------------------------

    def _next_version(self, weight_version: WeightVersion | None) -> WeightVersion:
        return self._changes + 1 if weight_version is None else check_version(weight_version)

    def _changed(self, version: WeightVersion) -> WeightVersion:
        self._changes += 1
        self.versions.set_all(version)
        return version

    async def update_weights(
        self, tensors: Any = None, *, path: str | os.PathLike | None = None, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Forward a weight update from ``path`` (on the servers' machine) to every server; returns
        the new version. In-process ``tensors`` cannot reach a remote server: 501."""
        if tensors is not None or path is None:
            raise NotSupportedError(
                "the chat backend forwards weight updates from a directory only: in-process tensors cannot reach "
                "a remote server. Save them (safetensors, save_pretrained) where the servers can read them and "
                'POST /update_weights {"update_info": {"path": DIR}}',
                code="control_not_supported",
            )
        version = self._next_version(weight_version)
        async with self._forwarding_change():
            await self.upstream_control.update_weights(str(path), version)
            return self._changed(version)

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        version = check_version(new_version, "new_version")
        async with self._forwarding_change():
            await self.upstream_control.update_weight_version(version)
            self._changed(version)

    def _forwarding_change(self):
        """Around a weight change sent to the servers (``ReplicaVersions.changing``): answers that
        overlap it get no version; nothing is sent without a flavour, so nothing changes then."""
        return self.versions.changing() if self._forwarding else contextlib.nullcontext()

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
        """Forward a LoRA load (a PEFT directory on the servers' machine) to every server."""
        if tensors is not None or lora_path is None:
            raise NotSupportedError(
                "the chat backend forwards LoRA adapters by path only: save the adapter (save_pretrained) where "
                "the servers can read it",
                code="control_not_supported",
            )
        version = self._next_version(weight_version)
        async with self._forwarding_change():
            await self.upstream_control.load_lora(lora_name, str(lora_path), load_inplace)
            return self._changed(version)

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        version = self._next_version(weight_version)
        async with self._forwarding_change():
            await self.upstream_control.unload_lora(lora_name)
            return self._changed(version)

    # ---- status ---------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read each server's version (``/health`` calls it; best effort: a failure keeps the last)."""
        await self.versions.refresh(force=True)

    def control_status(self) -> list[dict[str, Any]]:
        """Per replica ``{"replica", "weight_version" (None until known), "weight_updates",
        "version_overlaps" (answers left without a version: a change was forwarded while they ran),
        "paused", "pause_seconds_left", "upstream_control", "calls_waiting", "calls_in_flight"}``."""
        gate = self.gate.status()
        return [
            {
                "replica": redact_url(root),
                "weight_version": version,
                "weight_updates": self._changes,
                "version_overlaps": self.versions.overlaps[root],
                "upstream_control": self.upstream_control.flavour,
                **gate,
            }
            for root, version in self.versions.versions.items()
        ]

    async def close(self) -> None:
        self.gate.close()
        await self.upstream_control.close()
