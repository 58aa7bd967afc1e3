"""What the vLLM and TensorRT-LLM adapters keep themselves when the library does the weight work.

The libraries pause, load weights and load LoRA adapters; gymserve keeps what they do not: the
weight version (an int counting changes, or the trainer's name for them), which version sampled each
token (``TokenDelta.weight_version``), the pause deadline (neither library has one: the adapter
resumes by itself when it passes, and says so in the log), and one LoRA adapter at a time served as
the policy, as the transformers engine serves one (``engine.lora``; the local backend's model-name
rules, ``LocalBackend.check_model``, then hold for every engine). The libraries' own LoRA requests are
per call: the adapter passes the loaded adapter's request with every generation.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymserve.engine.base import NoControl, PauseMode, WeightVersion
from gymserve.engine.control import check_version
from gymserve.errors import NotFoundError, NotSupportedError, WeightUpdateError

log = logging.getLogger("gymserve.engine")


@dataclass
class LoadedLora:
    """The adapter served now: its name, the library's integer id, its directory and the library's
    request object (vLLM's / TensorRT-LLM's ``LoRARequest``)."""

    name: str
    int_id: int
    path: str
    request: Any
    version: WeightVersion


class LibraryControl(NoControl):
    """Mixed into an adapter before ``RunBasedEngine``; the adapter calls ``_init_control()`` in
    its constructor and implements the operations with its library's calls, using the helpers."""

    pause_timeout: float = 300.0

    def _init_control(self) -> None:
        self.weight_version = 0
        self._updates = 0
        self._paused: PauseMode | None = None
        self._deadline: float | None = None
        self._timer: asyncio.Task | None = None
        self._lora: LoadedLora | None = None
        self._lora_ids = 0
        self._change_lock: asyncio.Lock | None = None
        self.last_update_seconds: float | None = None

    def _lock(self) -> asyncio.Lock:
        if self._change_lock is None:
            self._change_lock = asyncio.Lock()
        return self._change_lock

    def _next_version(self, weight_version: WeightVersion | None) -> WeightVersion:
        return self._updates + 1 if weight_version is None else check_version(weight_version)

    def _changed(self, version: WeightVersion, started: float) -> WeightVersion:
        self._updates += 1
        self.weight_version = version
        self.last_update_seconds = time.perf_counter() - started
        log.info("%s engine: weights now version %r", self.engine_name, version)
        return version

    # ---- pause bookkeeping ----------------------------------------------------------------------

    def _paused_for(self, mode: PauseMode, timeout: float | None) -> None:
        """Record the pause and arm its deadline (``timeout`` s, default ``pause_timeout``)."""
        timeout = self.pause_timeout if timeout is None else timeout
        self._paused, self._deadline = mode, time.monotonic() + timeout
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().create_task(self._expire(mode, timeout))

    def _resumed(self) -> None:
        self._paused = self._deadline = None
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer = None

    async def _expire(self, mode: PauseMode, timeout: float) -> None:
        await asyncio.sleep(timeout)
        log.warning(
            "generation pause (mode %s) reached its deadline of %g s without resume_generation; resuming by itself",
            mode,
            timeout,
        )
        await self.resume_generation()

    async def is_paused(self) -> bool:
        return self._paused is not None

    # ---- LoRA bookkeeping -----------------------------------------------------------------------

    def _check_lora_load(self, lora_name: str, lora_path: str | None, tensors: Any, load_inplace: bool) -> Path:
        """Refuse what one-adapter-at-a-time cannot do, as ``engine.lora`` refuses it; the adapter
        directory (its ``adapter_config.json`` must exist)."""
        from gymserve.engine.lora import ADAPTER_CONFIG, check_lora_name, refuse_second_adapter

        check_lora_name(lora_name)
        if tensors is not None or lora_path is None:
            raise NotSupportedError(
                f"the {self.engine_name} engine loads LoRA adapters from a directory only (PEFT's "
                "save_pretrained layout); save the adapter and pass lora_path",
                code="control_not_supported",
            )
        refuse_second_adapter(
            self._lora.name if self._lora else None,
            lora_name,
            load_inplace,
            serving="serves as the policy",
        )
        path = Path(os.fspath(lora_path))
        if not (path / ADAPTER_CONFIG).is_file():
            raise WeightUpdateError(
                f"{path} is not a PEFT adapter directory: it has no {ADAPTER_CONFIG}", param="lora_path"
            )
        return path

    def _check_lora_unload(self, lora_name: str) -> LoadedLora:
        current = self._lora
        if current is None or current.name != lora_name:
            loaded = f"adapter {current.name!r} is" if current else "no adapter is"
            raise NotFoundError(
                f"The lora adapter '{lora_name}' cannot be found: {loaded} loaded",
                param="lora_name",
                code="lora_adapter_not_found",
            )
        return current

    def _new_lora_id(self, lora_name: str, load_inplace: bool) -> int:
        """The library's integer id: the loaded adapter's when replacing it under its own name in
        place, else a new one (ids start at 1; 0 means "no adapter" in both libraries)."""
        if load_inplace and self._lora is not None and self._lora.name == lora_name:
            return self._lora.int_id
        self._lora_ids += 1
        return self._lora_ids

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The adapter serving as the policy: ``[{"name", "source", "weight_version"}]``, or ``[]``."""
        s = self._lora
        return [] if s is None else [{"name": s.name, "source": s.path, "weight_version": s.version}]

    def control_status(self) -> dict[str, Any]:
        """``{"weight_version", "weight_updates", "paused", "pause_seconds_left",
        "last_update_seconds", "lora_adapter"}``."""
        left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        return {
            "weight_version": self.weight_version,
            "weight_updates": self._updates,
            "paused": self._paused,
            "pause_seconds_left": left,
            "last_update_seconds": self.last_update_seconds,
            "lora_adapter": self._lora.name if self._lora else None,
        }


def library_error(exc: BaseException, engine: str, what: str) -> Exception:
    """The ``GymserveError`` for a library exception during ``what``: its ``ValueError`` (a bad
    path, a checkpoint that does not fit) is a 400 ``invalid_weights`` with the library's words;
    anything else a 500 ``EngineError``. ``GymserveError``s pass through."""
    from gymserve.errors import EngineError, GymserveError

    if isinstance(exc, GymserveError):
        return exc
    if isinstance(exc, (ValueError, FileNotFoundError)):
        return WeightUpdateError(f"{engine} refused {what}: {exc}")
    return EngineError(f"{engine} failed during {what}: {type(exc).__name__}: {exc}")
