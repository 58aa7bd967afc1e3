"""LoRA adapters on the llamacpp engine (vLLM's operation names, ``engine.lora``'s rules).

llama.cpp applies an adapter at run time on top of the GGUF weights, unmerged
(``llama_set_adapters_lora`` on the context), so quantized base weights stay as they are and
unloading is exact. An adapter is a GGUF LoRA file (llama.cpp's ``convert_lora_to_gguf.py``
output), or a PEFT adapter directory, which is written as one first (``gguf_lora``). As on the
transformers engine: one adapter serves at a time (a second is refused with 409 unless it replaces
the first, ``load_inplace``), each load, swap or unload is a new weight version that takes effect
between two decode steps, with the KV cache recomputed, and a full weight update is refused while
an adapter is loaded.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymserve.engine.base import WeightVersion
from gymserve.engine.control import Command, check_version
from gymserve.engine.llamacpp_runtime import LlamaLora
from gymserve.engine.lora import check_lora_name, refuse_second_adapter
from gymserve.errors import ConflictError, EngineError, InvalidRequestError, NotFoundError, WeightUpdateError


@dataclass
class _Loaded:
    name: str
    source: str
    adapter: LlamaLora
    version: WeightVersion


class LlamaCppLora:
    """The LoRA operations of ``LlamaCppEngine`` (mixed in before ``WorkerControl``)."""

    model: Any
    ctx: Any
    _send: Any

    @property
    def _lora_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_lora_slot")
        if state is None:
            state = self.__dict__["_lora_slot"] = {"loaded": None, "lock": asyncio.Lock()}
        return state

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapter as ``[{"name", "source", "weight_version"}]``; ``[]`` when none."""
        cur: _Loaded | None = self._lora_state["loaded"]
        if cur is None:
            return []
        return [{"name": cur.name, "source": cur.source, "weight_version": cur.version}]

    def control_status(self) -> dict[str, Any]:
        """The control status (``engine.control``) plus ``lora_adapter``: the loaded adapter's name."""
        status = super().control_status()  # type: ignore[misc]
        cur: _Loaded | None = self._lora_state["loaded"]
        return {**status, "lora_adapter": cur.name if cur else None}

    def _refuse_while_lora(self, what: str) -> None:
        cur: _Loaded | None = self._lora_state["loaded"]
        if cur is not None:
            raise ConflictError(
                f"{what} refused: LoRA adapter {cur.name!r} is loaded on the current weights. Unload it first "
                "(POST /v1/unload_lora_adapter), or push the trained policy as an adapter (POST "
                "/v1/load_lora_adapter with load_inplace: true)",
                code="lora_adapter_merged",
            )

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | os.PathLike | None = None,
        *,
        tensors: Any = None,
        config: Any = None,
        load_inplace: bool = False,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Serve with an adapter from the next decode step on; returns the new weight version.

        ``lora_path``: a GGUF LoRA file, a directory holding one, or a PEFT adapter directory; or
        ``tensors`` with ``config`` (PEFT's state dict and ``peft.LoraConfig``). ``load_inplace``:
        replace the loaded adapter in one update. Raises ``InvalidRequestError`` (400) for a bad
        name or argument mix or an already loaded name, ``ConflictError`` (409) while another
        adapter is loaded, ``WeightUpdateError`` (400) naming the file or tensor for a bad adapter
        (nothing changed)."""
        lora_name = check_lora_name(lora_name)
        if (lora_path is None) == (tensors is None) or (tensors is not None and config is None):
            raise InvalidRequestError(
                "give lora_path (a GGUF LoRA file or a PEFT adapter directory) or tensors together with "
                "config (its peft.LoraConfig)",
                param="lora_path",
            )
        version = None if weight_version is None else check_version(weight_version)
        state = self._lora_state
        async with state["lock"]:
            cur: _Loaded | None = state["loaded"]
            refuse_second_adapter(cur.name if cur else None, lora_name, load_inplace, serving="is loaded")
            source = str(lora_path) if lora_path is not None else "tensors"
            adapter = await asyncio.to_thread(self._read_lora, lora_path, tensors, config)
            try:
                new = await self._send(Command("weights", apply=lambda: self.ctx.set_lora(adapter), version=version))
            except BaseException:
                adapter.close()
                raise
            if cur is not None:
                cur.adapter.close()
            state["loaded"] = _Loaded(lora_name, source, adapter, new)
            return new

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Serve the base weights again from the next decode step on; returns the new weight
        version. Raises ``NotFoundError`` (404) when that adapter is not loaded."""
        lora_name = check_lora_name(lora_name)
        version = None if weight_version is None else check_version(weight_version)
        state = self._lora_state
        async with state["lock"]:
            cur: _Loaded | None = state["loaded"]
            if cur is None or cur.name != lora_name:
                loaded = f"adapter {cur.name!r} is" if cur else "no adapter is"
                raise NotFoundError(
                    f"The lora adapter '{lora_name}' cannot be found: {loaded} loaded",
                    param="lora_name",
                    code="lora_adapter_not_found",
                )
            new = await self._send(Command("weights", apply=lambda: self.ctx.set_lora(None), version=version))
            cur.adapter.close()
            state["loaded"] = None
            return new

    def close_lora(self) -> None:
        """Free the loaded adapter (at shutdown, after the context is freed)."""
        cur: _Loaded | None = self._lora_state["loaded"]
        if cur is not None:
            cur.adapter.close()
            self._lora_state["loaded"] = None

    def _read_lora(self, path: str | os.PathLike | None, tensors: Any, config: Any) -> LlamaLora:
        """The adapter loaded by llama.cpp for this model (off the worker)."""
        from gymserve.engine.gguf_lora import write_gguf_lora

        p = Path(path) if path is not None else None
        gguf_file = None
        if p is not None and p.is_file():
            gguf_file = p
        elif p is not None and p.is_dir() and not (p / "adapter_config.json").exists():
            found = sorted(p.glob("*.gguf"))
            if len(found) != 1:
                raise WeightUpdateError(
                    f"{p} holds {len(found)} .gguf files and no adapter_config.json; give a GGUF LoRA file or a "
                    "PEFT adapter directory",
                    param="lora_path",
                )
            gguf_file = found[0]
        try:
            if gguf_file is not None:
                adapter = LlamaLora(self.model, gguf_file)
            else:
                with tempfile.TemporaryDirectory(prefix="gymserve-lora-") as tmp:
                    out = write_gguf_lora(
                        p,
                        Path(tmp) / "adapter.gguf",
                        architecture=self.model.architecture,
                        tensors=tensors,
                        config=config,
                    )
                    adapter = LlamaLora(self.model, out)  # llama.cpp copies the tensors: the file may go
        except EngineError as exc:
            raise WeightUpdateError(str(exc), param="lora_path") from exc
        return adapter
