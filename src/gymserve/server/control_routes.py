"""The HTTP routes of the control plane (``gymserve.control.Control``) for serving a policy being
trained: pause, resume, weight updates, weight versions, LoRA adapters. Each route checks its body
(pydantic, 400 naming the field) and calls ``control_of(backend).verb(...)``; nothing else is here
but the guard, ``/health``'s control fields and the ``/metrics`` collector.

The routes are named and shaped as vLLM's RL endpoints (``vllm serve`` with its dev endpoints
enabled); docs/concepts/training-control.md maps each to SGLang's. gymserve's additions are marked.

=================================  =========================================================
route                              answer
=================================  =========================================================
``POST /pause?mode=&timeout=``     ``{"status": "paused", "mode", "timeout"}`` once the pause has taken
                                   effect; ``timeout`` (seconds, gymserve's) is the deadline after
                                   which generation resumes by itself
``POST /resume``                   ``{"status": "resumed"}``
``GET /is_paused``                 ``{"is_paused", "mode", "seconds_left"}``
``POST /update_weights``           body ``{"update_info": {"path": DIR}, "weight_version": V}``
                                   (vLLM's disk transfer; ``weight_version`` is gymserve's, vLLM takes
                                   it in ``/finish_weight_update``) → ``{"message", "weight_version",
                                   "seconds"}``; mounted by ``server.weight_sync_routes``, which also
                                   takes vLLM's process-group form of it
``POST /start_weight_update``      ``{"message"}``: opens vLLM's weight-update session (nothing is
                                   held in it: a second start opens a new one)
``POST /finish_weight_update``     body ``{"weight_version": V}`` (optional) → ``{"message",
                                   "weight_version"}``: closes the session and names the weights V
                                   (a rename, unless V already names them); 409 without a session
``GET /weight_info``               ``{"weight_version", "weight_updates", ...}``
``POST /update_weight_version``    body ``{"new_version": V}`` → ``{"success": true, "new_version": V}``
=================================  =========================================================

LoRA routes, named and shaped as vLLM's runtime LoRA endpoints (``vllm serve`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; SGLang's are ``/load_lora_adapter`` and
``/unload_lora_adapter`` with the same names):

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
adapter (``LocalBackend.check_model``).

With the session routes a gymserve answers vLLM's whole disk-transfer sequence (``start_weight_update``,
``update_weights``, ``finish_weight_update``), so a chat gateway with ``upstream_control: vllm``
drives a gymserve behind it like a vLLM server.

Who may call them: with ``server.admin_api_key`` set, only that key; otherwise the server API key
when one is set (``server.auth``); on a loopback bind without any key, anyone who can connect. A
server bound beyond loopback without a key answers every control route 403 (decided at start-up,
``control_allowed``), so an open port never lets a stranger swap the policy. Errors are OpenAI error
objects: 400 bad input (``WeightUpdateError`` names the tensor or file; a bad adapter, naming the
tensor or config field), 401, 403, 404 (unloading an adapter that is not loaded), 409 (a ``wait``
pause that ended before the calls in flight finished; another adapter is merged), 501 (a backend
without weights of its own, or an engine without LoRA).

Adding a route for a new control verb: declare the verb on ``gymserve.control.Control``, add its
path to ``CONTROL_PATHS`` (so the admin key guards it) and one ``@route`` below calling
``control_of(backend).verb(...)``.

In-process tensors do not travel over HTTP: a trainer in the same process calls
``backend.control.update_weights(state_dict)`` (see ``server.embed``).
"""

from __future__ import annotations

import ipaddress
import time
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from gymserve.control import MAX_PAUSE_SECONDS, control_of
from gymserve.errors import ConflictError, NotSupportedError, PermissionDeniedError

CONTROL_PATHS = frozenset(
    {
        "/pause",
        "/resume",
        "/is_paused",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/weight_info",
        "/update_weight_version",
    }
)
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

Version = Annotated[
    StrictInt | Annotated[StrictStr, Field(min_length=1, max_length=256)],
    Field(description='an integer, or a name such as "step-12" (SGLang\'s weight_version)'),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 400 naming it, never ignored


class UpdateInfo(_Body):
    """vLLM's ``update_info`` for its disk weight transfer: where the new weights are."""

    path: str = Field(
        min_length=1,
        description="a directory in Hugging Face layout (model.safetensors, or shards "
        "with model.safetensors.index.json) or one .safetensors file, on the server's machine; full "
        "weights or any subset of the tensors",
    )


class UpdateWeightVersionRequest(_Body):
    new_version: Version


class FinishWeightUpdateRequest(_Body):
    weight_version: Version | None = Field(
        None, description="the updated weights' version (vLLM's finish_weight_update field; vLLM takes strings)"
    )


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


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def control_allowed(host: str, *keys: str | None) -> bool:
    """The start-up rule: control routes are served on a loopback bind, or when a key guards them."""
    return is_loopback(host) or any(keys)


def control_health(backend: Any) -> dict[str, Any]:
    """What ``/health`` adds: ``weight_version`` and ``paused`` (the mode, or None) for one
    replica, ``replicas_control`` (each replica's status) for several, nothing without weights."""
    status = control_of(backend).control_status()
    if len(status) == 1:
        return {"weight_version": status[0]["weight_version"], "paused": status[0]["paused"]}
    return {"replicas_control": status} if status else {}


class _ControlCollector:
    """``/metrics``: each replica's weight version, updates, pause state and last update time."""

    def __init__(self, backend: Any):
        self.backend = backend

    def collect(self):
        name = getattr(self.backend, "name", "backend")
        labels = ["backend", "replica"]
        version = GaugeMetricFamily(
            "gymserve_weight_version_info",
            "The weight version serving (value 1; the version is the label)",
            labels=[*labels, "version"],
        )
        updates = CounterMetricFamily(
            "gymserve_weight_updates", "Weight updates applied (renames included)", labels=labels
        )
        paused = GaugeMetricFamily("gymserve_generation_paused", "1 while generation is paused", labels=labels)
        overlaps = CounterMetricFamily(
            "gymserve_version_overlaps",
            "Answers the chat gateway left with weight_version null: a weight change was forwarded while they ran",
            labels=labels,
        )
        seconds = GaugeMetricFamily(
            "gymserve_weight_update_last_seconds",
            "Seconds the last weight update took (read, validate, apply)",
            labels=labels,
        )
        for s in control_of(self.backend).control_status():
            replica = str(s.get("replica", "-"))
            if s.get("weight_version") is not None:  # a gateway before it has read its servers' versions
                version.add_metric([name, replica, str(s["weight_version"])], 1)
            updates.add_metric([name, replica], s.get("weight_updates", 0))
            paused.add_metric([name, replica], 1 if s.get("paused") else 0)
            if s.get("last_update_seconds") is not None:
                seconds.add_metric([name, replica], s["last_update_seconds"])
            if s.get("version_overlaps") is not None:
                overlaps.add_metric([name, replica], s["version_overlaps"])
        yield from (version, updates, paused, seconds, overlaps)

    def describe(self):
        return []


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {
        "description": what,
        "content": {
            "application/json": {
                "schema": {"type": "object", "properties": {"error": {"type": "object"}}, "required": ["error"]}
            }
        },
    }
    for code, what in (
        (400, "bad input (the message names the field, tensor or file)"),
        (401, "missing or wrong key"),
        (403, "control routes are closed on this bind (no key set)"),
        (409, "a wait pause ended before the calls in flight finished, or no weight update session is open"),
        (501, "the backend has no weights of its own"),
    )
}


_LORA_ERRORS: dict[int | str, dict[str, Any]] = {code: dict(entry) for code, entry in _ERRORS.items()}
_LORA_ERRORS[404] = {"description": "no LoRA adapter of that name is loaded", "content": _ERRORS[400]["content"]}
_LORA_ERRORS[409] = {
    "description": "another LoRA adapter is merged (one at a time), or a wait pause ended",
    "content": _ERRORS[400]["content"],
}


def control_guard(allowed: bool):
    """The route dependency that answers 403 when ``allowed`` is False (see ``control_allowed``)."""

    def guard() -> None:
        if not allowed:
            raise PermissionDeniedError(
                "control endpoints are closed: this server listens beyond loopback without an API key. Set "
                "server.admin_api_key (or server.api_key), or bind 127.0.0.1",
                code="control_closed",
            )

    return guard


def install_control(app: FastAPI, backend: Any, *, allowed: bool, registry: Any = None) -> None:
    """Mount the control and LoRA routes on ``app`` over ``control_of(backend)``; ``allowed`` False
    answers them 403 (see ``control_allowed``). ``registry``: the app's Prometheus registry for
    the control metrics."""
    guard = control_guard(allowed)

    # Routes go on the app itself (not an included APIRouter) so app.routes lists each one.
    def route(method: str, path: str, summary: str, responses: dict[int | str, dict[str, Any]] = _ERRORS):
        return app.api_route(
            path,
            methods=[method],
            summary=summary,
            tags=["training control"],
            dependencies=[Depends(guard)],
            responses=responses,
        )

    @route("POST", "/pause", "Pause generation (vLLM's POST /pause)")
    async def pause(
        mode: Annotated[
            Literal["abort", "wait", "keep"],
            Query(
                description="abort: end calls in flight now (finish_reason abort, tokens kept); wait: let "
                "them finish, then pause; keep: freeze them until /resume"
            ),
        ] = "abort",
        timeout: Annotated[
            float | None,
            Query(
                gt=0,
                le=MAX_PAUSE_SECONDS,
                description="seconds after which generation resumes by itself, at most 86400 (one day; a larger "
                "value is a 400) (default: local backend's pause_timeout)",
            ),
        ] = None,
    ):
        await control_of(backend).pause_generation(mode, timeout=timeout)
        return {"status": "paused", "mode": mode, "timeout": timeout}

    @route("POST", "/resume", "Resume generation (vLLM's POST /resume)")
    async def resume():
        await control_of(backend).resume_generation()
        return {"status": "resumed"}

    @route("GET", "/is_paused", "Whether generation is paused (vLLM's GET /is_paused)")
    async def is_paused():
        status = control_of(backend).control_status()
        first = status[0] if status else {}
        return {
            "is_paused": await control_of(backend).is_paused(),
            "mode": first.get("paused"),
            "seconds_left": first.get("pause_seconds_left"),
        }

    session = {"open": False}  # vLLM's weight-update session (start / finish_weight_update)

    def serving() -> list[dict[str, Any]]:
        """The control's ``control_status()``; 501 for a backend without weights of its own."""
        status = control_of(backend).control_status()
        if not status:
            raise NotSupportedError(
                f"the {backend.name} backend has no weights of its own, so no weight version; ask the upstream server",
                code="control_not_supported",
            )
        return status

    @route("POST", "/start_weight_update", "Open a weight-update session (vLLM's POST /start_weight_update)")
    async def start_weight_update():
        serving()
        session["open"] = True
        return {"message": "Weight update started"}

    @route("POST", "/finish_weight_update", "Close the session, naming the weights (vLLM's POST /finish_weight_update)")
    async def finish_weight_update(body: FinishWeightUpdateRequest | None = None):
        version = serving()[0]["weight_version"]
        if not session["open"]:
            raise ConflictError(
                "no weight update session is open: POST /start_weight_update, then /update_weights, then "
                "/finish_weight_update (vLLM's sequence); or POST /update_weights alone with its weight_version",
                code="no_weight_update_session",
            )
        session["open"] = False
        wanted = body.weight_version if body is not None else None
        if wanted is not None and str(wanted) != str(version):  # vLLM's versions are strings: "3" names 3
            await control_of(backend).update_weight_version(wanted)
            version = wanted
        return {"message": "Weight update finished", "weight_version": version}

    @route("GET", "/weight_info", "The weight version serving (vLLM's GET /weight_info)")
    async def weight_info():
        status = serving()
        info = dict(status[0]) if len(status) == 1 else {"replicas": status}
        receiver = getattr(app.state, "weight_receiver", None)  # server.weight_sync_routes
        return {**info, "weight_transfer": receiver.status()} if receiver is not None else info

    @route("POST", "/update_weight_version", "Name the serving weights (vLLM's POST /update_weight_version)")
    async def update_weight_version(body: UpdateWeightVersionRequest):
        await control_of(backend).update_weight_version(body.new_version)
        return {"success": True, "new_version": body.new_version}

    @route("POST", "/v1/load_lora_adapter", "Load a LoRA adapter (vLLM's POST /v1/load_lora_adapter)", _LORA_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        t0 = time.perf_counter()
        version = await control_of(backend).load_lora_adapter(
            body.lora_name, body.lora_path, load_inplace=body.load_inplace, weight_version=body.weight_version
        )
        return {
            "message": f"Success: LoRA adapter '{body.lora_name}' added successfully.",
            "lora_name": body.lora_name,
            "weight_version": version,
            "seconds": round(time.perf_counter() - t0, 6),
        }

    @route(
        "POST", "/v1/unload_lora_adapter", "Unload a LoRA adapter (vLLM's POST /v1/unload_lora_adapter)", _LORA_ERRORS
    )
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        t0 = time.perf_counter()
        version = await control_of(backend).unload_lora_adapter(body.lora_name, weight_version=body.weight_version)
        return {
            "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
            "lora_name": body.lora_name,
            "weight_version": version,
            "seconds": round(time.perf_counter() - t0, 6),
        }

    if registry is not None:
        registry.register(_ControlCollector(backend))
