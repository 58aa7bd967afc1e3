"""HTTP routes for LoRA adapters, named and shaped as vLLM's runtime LoRA endpoints (``vllm serve``
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):

==================================  ===============================================================
route                               body → answer
==================================  ===============================================================
``POST /v1/load_lora_adapter``      ``{"lora_name", "lora_path", "load_inplace": false}`` (vLLM's
                                    fields) and gymserve's ``"weight_version"`` → ``{"message",
                                    "lora_name", "weight_version", "seconds"}``
``POST /v1/unload_lora_adapter``    ``{"lora_name", "lora_int_id"}`` (vLLM's; the id is accepted and
                                    not needed) and ``"weight_version"`` → the same fields
==================================  ===============================================================

``lora_path`` is a PEFT adapter directory on the server's machine (``adapter_config.json`` +
``adapter_model.safetensors``). vLLM answers a plain-text ``Success: ...`` line; gymserve answers
JSON whose ``message`` is that line, plus the new weight version. A request's ``model`` picks the
adapter (``backends.local_lora``). SGLang's equivalents are ``/load_lora_adapter`` and
``/unload_lora_adapter`` with the same two names.

The routes share the control routes' guard (``server.control``): the admin key when one is set,
403 beyond loopback without any key. Errors: 400 (bad adapter, naming the tensor or config field;
name already loaded), 404 (unloading an adapter that is not loaded), 409 (another adapter is merged:
one at a time), 501 (a backend or engine without LoRA).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Depends, FastAPI
from pydantic import Field, StrictBool

from gymserve.server.control import _ERRORS, Version, _Body, control_guard

LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

_LORA_ERRORS: dict[int | str, dict[str, Any]] = {code: dict(entry) for code, entry in _ERRORS.items()}
_LORA_ERRORS[404] = {"description": "no LoRA adapter of that name is loaded", "content": _ERRORS[400]["content"]}
_LORA_ERRORS[409] = {
    "description": "another LoRA adapter is merged (one at a time), or a wait pause ended",
    "content": _ERRORS[400]["content"],
}

Name = Field(
    min_length=1,
    max_length=256,
    description="the adapter's name; requests name it in `model` (the base "
    "model's name: it replaces the policy under that name)",
)


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Name
    lora_path: str = Field(
        min_length=1,
        description="a PEFT adapter directory (adapter_config.json + "
        "adapter_model.safetensors) on the server's machine",
    )
    load_inplace: StrictBool = Field(
        False,
        description="replace the adapter loaded now (this name or another) in "
        "one atomic update; without it a second adapter is refused",
    )
    weight_version: Version | None = Field(
        None, description="the new weights' version (default: the number of updates so far); gymserve's"
    )


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Name
    lora_int_id: int | None = Field(None, description="vLLM's adapter id; accepted, not needed")
    weight_version: Version | None = Field(None, description="the restored weights' version; gymserve's")


def install_lora(app: FastAPI, backend: Any, *, allowed: bool) -> None:
    """Mount the LoRA routes on ``app`` over ``backend``; ``allowed`` as for ``install_control``."""
    guard = control_guard(allowed)

    def route(path: str, summary: str):  # on the app itself, as the control routes, so app.routes lists them
        return app.api_route(
            path,
            methods=["POST"],
            summary=summary,
            tags=["training control"],
            dependencies=[Depends(guard)],
            responses=_LORA_ERRORS,
        )

    @route("/v1/load_lora_adapter", "Load a LoRA adapter (vLLM's POST /v1/load_lora_adapter)")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        t0 = time.perf_counter()
        version = await backend.load_lora_adapter(
            body.lora_name, body.lora_path, load_inplace=body.load_inplace, weight_version=body.weight_version
        )
        return {
            "message": f"Success: LoRA adapter '{body.lora_name}' added successfully.",
            "lora_name": body.lora_name,
            "weight_version": version,
            "seconds": round(time.perf_counter() - t0, 6),
        }

    @route("/v1/unload_lora_adapter", "Unload a LoRA adapter (vLLM's POST /v1/unload_lora_adapter)")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        t0 = time.perf_counter()
        version = await backend.unload_lora_adapter(body.lora_name, weight_version=body.weight_version)
        return {
            "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
            "lora_name": body.lora_name,
            "weight_version": version,
            "seconds": round(time.perf_counter() - t0, 6),
        }
