"""HTTP routes for process-group weight sync, in vLLM's, SGLang's and SkyRL's vocabularies, all
mapped onto one implementation (``engine.weight_transfer.WeightReceiver`` over the backend's
in-process ``update_weights``, through its ``gymserve.control.Control``), and the disk form of vLLM's ``/update_weights``.

==========================================  =================================================================
route (whose)                               body → answer
==========================================  =================================================================
``POST /init_weight_transfer_engine``       ``{"init_info": {"master_address", "master_port", "rank_offset",
(vLLM)                                      "world_size"}}`` + gymserve's ``backend`` (default ``gloo``),
                                            ``group_name``, ``timeout`` in ``init_info`` → ``{"message",
                                            "group"}`` once the trainer has joined
``POST /init_weights_update_group``         ``{"master_address", "master_port", "rank_offset", "world_size",
(SGLang)                                    "group_name", "backend"}`` (SGLang's default backend ``nccl``) +
                                            gymserve's ``timeout`` → ``{"success": true, "message"}``
``POST /init_weight_update_communicator``   SGLang's body + ``override_existing`` → ``{"success": true,
(SkyRL)                                     "message", "status": "ok"}``
``POST /update_weights`` (vLLM)             ``{"update_info": {"names", "dtype_names", "shapes", "packed",
                                            "packed_buffer_size_bytes", "is_checkpoint_format"}}`` (the
                                            transfer) or ``{"update_info": {"path"}}`` (disk), +
                                            gymserve's ``weight_version`` and ``pause_mode`` → ``{"message",
                                            "weight_version", "seconds", ...}``
``POST /update_weights_from_distributed``   ``{"names", "dtypes", "shapes", "group_name", "flush_cache",
(SGLang)                                    "abort_all_requests", "weight_version"}`` → ``{"success": true,
                                            "message", "weight_version", ...}``
``POST /destroy_weights_update_group``      ``{"group_name"}`` → ``{"success": true, "message"}``
(SGLang, SkyRL)
``POST /update_weights_from_tensor``        501: SGLang's body carries serialized in-process tensor handles
(SGLang)                                    (CUDA IPC), which a server in another process cannot open
==========================================  =================================================================

The bytes travel over the group, never over HTTP: the trainer posts the metadata and broadcasts at
once (``gymserve.trainer.WeightSender`` does both). Every field is applied or refused: an unknown
one is a 400 naming it. Errors: 400 a malformed body, a tensor the served model refuses (name,
shape, dtype: nothing changed) or a failed transfer (code ``weight_transfer_failed``: the trainer
died, the connection dropped or the group's timeout passed; the group is closed, nothing changed);
409 no group open; 501 a backend without weights of its own.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from gymserve.control import control_of
from gymserve.engine.weight_transfer import DEFAULT_GROUP, DEFAULT_TIMEOUT, WeightReceiver, parse_metadata
from gymserve.errors import InvalidRequestError, NotSupportedError
from gymserve.server.control_routes import _ERRORS, UpdateInfo, Version, control_guard

WEIGHT_SYNC_PATHS = frozenset(
    {
        "/init_weight_transfer_engine",
        "/init_weights_update_group",
        "/init_weight_update_communicator",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/update_weights_from_tensor",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
        "/abort_requests",
    }
)
VLLM_PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES (1 GiB)

PauseModeField = Field(
    None,
    description="gymserve's: pause generation in this mode (vLLM's abort / wait / keep) around the swap; "
    "default none (calls in flight continue on the new weights from their next step)",
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it, never ignored


class GroupFields(_Body):
    """The rendezvous: the trainer (rank 0) hosts it at ``master_address:master_port``."""

    master_address: StrictStr = Field(min_length=1, description="the trainer's address, reachable from the server")
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(1, ge=1, description="the server's first rank (the trainer is 0)")
    world_size: StrictInt = Field(2, ge=2, description="ranks in the group: the trainer's and the servers'")
    timeout: float = Field(
        DEFAULT_TIMEOUT, gt=0, description="gymserve's: seconds the rendezvous and each broadcast may take"
    )


class InitInfo(GroupFields):
    """vLLM's ``init_info`` (its NCCL backend's fields) + gymserve's ``backend`` and ``group_name``."""

    backend: Literal["gloo", "nccl"] = Field("gloo", description="gymserve's: gloo (CPU tensors) or nccl (CUDA)")
    group_name: StrictStr = Field(DEFAULT_GROUP, min_length=1, description="gymserve's: the store prefix")


class InitTransferEngineRequest(_Body):
    init_info: InitInfo


class InitGroupRequest(GroupFields):
    """SGLang's ``/init_weights_update_group`` body."""

    group_name: StrictStr = Field(DEFAULT_GROUP, min_length=1)
    backend: Literal["gloo", "nccl"] = Field("nccl", description="SGLang's default is nccl; gloo on CPU")


class InitCommunicatorRequest(InitGroupRequest):
    """SkyRL's ``/init_weight_update_communicator`` body: SGLang's + ``override_existing``."""

    override_existing: StrictBool = Field(False, description="close an open group first instead of a 409")


class TransferUpdateInfo(_Body):
    """vLLM's ``update_info`` for its NCCL weight transfer (``NCCLWeightTransferUpdateInfo``)."""

    names: list[StrictStr] = Field(min_length=1, description="state-dict names, in broadcast order")
    dtype_names: list[StrictStr] = Field(description='torch dtype names, e.g. "bfloat16"')
    shapes: list[list[StrictInt]]
    packed: StrictBool = Field(False, description="tensors packed into byte buckets (false: one broadcast each)")
    packed_buffer_size_bytes: StrictInt = Field(
        VLLM_PACKED_BUFFER_BYTES, gt=0, description="bucket size when packed (gymserve's bucket layout)"
    )
    is_checkpoint_format: StrictBool = Field(
        True, description="vLLM's; gymserve takes state-dict (checkpoint) names only, so false is refused"
    )


class UpdateWeightsRequest(_Body):
    """vLLM's ``/update_weights``: the transfer's metadata or the disk form's ``path``
    (``update_info`` is read as ``TransferUpdateInfo`` when it has ``names``, else as ``UpdateInfo``,
    so a validation error names the field of the form meant, ``update_info.path``, not a union branch)."""

    update_info: dict[str, Any] = Field(
        description="vLLM's transfer metadata (names, dtype_names, shapes, packed, packed_buffer_size_bytes, "
        "is_checkpoint_format) or the disk form's path"
    )
    weight_version: Version | None = Field(
        None, description="the new weights' version (default: the number of updates so far); gymserve's"
    )
    pause_mode: Literal["abort", "wait", "keep"] | None = PauseModeField


class UpdateFromDistributedRequest(_Body):
    """SGLang's ``/update_weights_from_distributed`` body."""

    names: list[StrictStr] = Field(min_length=1)
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = DEFAULT_GROUP
    flush_cache: StrictBool = Field(
        True, description="SGLang's; gymserve always recomputes the KV cache of calls in flight, so false is refused"
    )
    abort_all_requests: StrictBool = Field(False, description="SGLang's: pause in mode abort around the swap")
    weight_version: Version | None = None
    load_format: StrictStr | None = Field(None, description="SGLang's; only null (state-dict tensors) is taken")


class DestroyGroupRequest(_Body):
    group_name: StrictStr = DEFAULT_GROUP


def _model_device(backend: Any) -> Any:
    """The served model's device (NCCL receives there); None when the backend holds no model here."""
    model = getattr(getattr(backend, "engine", None), "model", None)
    try:
        return next(model.parameters()).device if model is not None else None
    except (AttributeError, StopIteration, TypeError):
        return None


def install_weight_sync(app: FastAPI, backend: Any, *, allowed: bool) -> WeightReceiver:
    """Mount the weight-sync routes (and ``/update_weights``) on ``app`` over ``backend``;
    ``allowed`` as for ``server.control_routes.install_control``. Returns the receiver (``app.state.weight_receiver``)."""
    guard = control_guard(allowed)
    control = control_of(backend)  # the backend's Control (gymserve.control): the swap, pause and status
    receiver = WeightReceiver(control, device=_model_device(backend))
    app.state.weight_receiver = receiver

    def route(path: str, summary: str):
        return app.api_route(
            path,
            methods=["POST"],
            summary=summary,
            tags=["training control"],
            dependencies=[Depends(guard)],
            responses=_ERRORS,
        )

    def has_weights() -> None:
        if not control.control_status():
            raise NotSupportedError(
                f"the {backend.name} backend has no weights of its own, so nothing to transfer into; "
                "sync the upstream server",
                code="control_not_supported",
            )

    async def open_group(body: GroupFields, backend_name: str, group_name: str, override: bool) -> dict[str, Any]:
        has_weights()
        return await receiver.init(
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            backend=backend_name,
            group_name=group_name,
            timeout=body.timeout,
            override_existing=override,
        )

    @route("/init_weight_transfer_engine", "Join the trainer's weight-transfer group (vLLM's)")
    async def init_weight_transfer_engine(body: InitTransferEngineRequest):
        info = body.init_info
        group = await open_group(info, info.backend, info.group_name, True)
        return {"message": "Weight transfer engine initialized", "group": group}

    @route("/init_weights_update_group", "Join the trainer's weight-update group (SGLang's)")
    async def init_weights_update_group(body: InitGroupRequest):
        group = await open_group(body, body.backend, body.group_name, True)
        return {"success": True, "message": "Succeeded to initialize custom process group.", "group": group}

    @route("/init_weight_update_communicator", "Join the trainer's weight-update group (SkyRL's)")
    async def init_weight_update_communicator(body: InitCommunicatorRequest):
        group = await open_group(body, body.backend, body.group_name, body.override_existing)
        return {"success": True, "status": "ok", "message": "Weight update communicator initialized", "group": group}

    async def transfer(metas_args: tuple, bucket_bytes: int, version: Any, pause_mode: Any, dtype_param: str):
        has_weights()
        metas = parse_metadata(*metas_args, dtype_param=dtype_param)
        return await receiver.update(metas, bucket_bytes=bucket_bytes, weight_version=version, pause_mode=pause_mode)

    @route("/update_weights", "New weights over the group or from disk (vLLM's POST /update_weights)")
    async def update_weights(body: UpdateWeightsRequest):
        t0 = time.perf_counter()
        form = TransferUpdateInfo if "names" in body.update_info else UpdateInfo
        try:
            info = form.model_validate(body.update_info)
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", "update_info", *e["loc"])} for e in exc.errors(include_url=False)]
            ) from None
        if isinstance(info, UpdateInfo):
            if body.pause_mode is not None:
                await control.pause_generation(body.pause_mode)
            try:
                version = await control.update_weights(path=info.path, weight_version=body.weight_version)
            finally:
                if body.pause_mode is not None:
                    await control.resume_generation()
            return {
                "message": "Weights updated",
                "weight_version": version,
                "seconds": round(time.perf_counter() - t0, 6),
            }
        if not info.is_checkpoint_format:
            raise InvalidRequestError(
                "update_info.is_checkpoint_format false (kernel-format weights) is vLLM's; gymserve takes the "
                "model's state-dict (checkpoint) names and layouts only",
                param="update_info.is_checkpoint_format",
            )
        result = await transfer(
            (info.names, info.dtype_names, info.shapes),
            info.packed_buffer_size_bytes if info.packed else 0,
            body.weight_version,
            body.pause_mode,
            "update_info.dtype_names",
        )
        return {"message": "Weights updated", **result}

    def check_group_name(name: str) -> None:
        group = receiver.status()["group"]
        if group is not None and group["group_name"] != name:
            raise InvalidRequestError(
                f"group_name {name!r}: the open group is {group['group_name']!r}", param="group_name"
            )

    @route("/update_weights_from_distributed", "New weights over the group (SGLang's)")
    async def update_weights_from_distributed(body: UpdateFromDistributedRequest):
        if not body.flush_cache:
            raise InvalidRequestError(
                "flush_cache false is refused: gymserve recomputes the KV cache of calls in flight on the new "
                "weights, so every token's log-prob is the new policy's",
                param="flush_cache",
            )
        if body.load_format is not None:
            raise InvalidRequestError(
                f"load_format {body.load_format!r}: gymserve takes state-dict tensors only (load_format null)",
                param="load_format",
            )
        check_group_name(body.group_name)
        result = await transfer(
            (body.names, body.dtypes, body.shapes),
            0,  # SGLang broadcasts one tensor at a time
            body.weight_version,
            "abort" if body.abort_all_requests else None,
            "dtypes",
        )
        return {"success": True, "message": "Succeeded to update parameter online.", **result}

    @route("/destroy_weights_update_group", "Leave the weight-update group (SGLang's and SkyRL's)")
    async def destroy_weights_update_group(body: DestroyGroupRequest | None = None):
        if body is not None:
            check_group_name(body.group_name)
        was = await receiver.destroy()
        return {"success": True, "message": "Succeeded to destroy custom process group." if was else "No group open."}

    @route("/update_weights_from_tensor", "Not served: in-process tensor handles (SGLang's)")
    async def update_weights_from_tensor():
        raise NotSupportedError(
            "/update_weights_from_tensor carries serialized in-process tensor handles (CUDA IPC), which only a "
            "process on the same device can open; use /update_weights_from_distributed (a process group) or, in "
            "the trainer's own process, serve_policy(...).update_weights(state_dict)",
            code="not_supported",
        )

    install_sleep(app, backend, route, guard)
    return receiver


class SleepRequest(_Body):
    """SkyRL's ``/sleep`` body (vLLM takes ``level`` as a query parameter)."""

    level: StrictInt | None = None


class AbortRequestsRequest(_Body):
    """vLLM's ``/abort_requests`` body, and SGLang's ``abort_all`` (``/abort_request``)."""

    request_ids: list[StrictStr] = Field(default_factory=list, description="vLLM's: the calls to end")
    abort_all: StrictBool = Field(False, description="SGLang's: end every call in flight")


def _engine_of(backend: Any, verb: str) -> Any:
    engine = getattr(backend, "engine", None)
    if engine is None:
        raise NotSupportedError(
            f"{verb} needs an engine in this process; the {backend.name} backend has none here (a Ray fleet or a "
            "gateway: send it to the servers themselves)",
            code="sleep_not_supported",
        )
    return engine


def install_sleep(app: FastAPI, backend: Any, route: Any, guard: Any) -> None:
    """vLLM's memory verbs (``engine.sleep``): ``POST /sleep?level=``, ``POST /wake_up?tags=``,
    ``GET /is_sleeping``, ``POST /reset_prefix_cache``, and ``POST /abort_requests``."""
    from gymserve.engine import sleep as sleep_mode

    @route("/sleep", "Drop caches (level 1) and release the weights (level 2) (vLLM's POST /sleep)")
    async def sleep(
        level: Annotated[int | None, Query(description="1: drop the KV and prefix caches; 2: also the weights")] = None,
        body: SleepRequest | None = None,
    ):
        wanted = {v for v in (level, body.level if body is not None else None) if v is not None}
        if len(wanted) > 1:
            raise InvalidRequestError(f"level given twice, differently: {sorted(wanted)}", param="level")
        out = await sleep_mode.sleep(_engine_of(backend, "sleep"), wanted.pop() if wanted else 1)
        return {"status": "sleeping", **out}

    @route("/wake_up", "Take memory back (vLLM's POST /wake_up)")
    async def wake_up(
        tags: Annotated[list[str] | None, Query(description="weights, kv_cache (default both)")] = None,
    ):
        out = await sleep_mode.wake_up(_engine_of(backend, "wake_up"), tags)
        return {"status": "awake" if out["level"] == 0 else "sleeping", **out}

    @app.api_route(
        "/is_sleeping",
        methods=["GET"],
        summary="Whether the engine sleeps (vLLM's GET /is_sleeping)",
        tags=["training control"],
        dependencies=[Depends(guard)],
        responses=_ERRORS,
    )
    async def is_sleeping():
        status = sleep_mode.sleep_status(getattr(backend, "engine", None))
        if status is None:
            _engine_of(backend, "is_sleeping")
            raise NotSupportedError(
                f"the {type(backend.engine).__name__} engine has no sleep mode", code="sleep_not_supported"
            )
        return status

    @route("/reset_prefix_cache", "Drop the KV kept between calls (vLLM's POST /reset_prefix_cache)")
    async def reset_prefix_cache():
        out = await sleep_mode.reset_prefix_cache(_engine_of(backend, "reset_prefix_cache"))
        return {"status": "ok", **out}

    @route("/abort_requests", "End calls in flight (vLLM's POST /abort_requests)")
    async def abort_requests(body: AbortRequestsRequest):
        if body.request_ids:
            raise NotSupportedError(
                "request_ids: gymserve's engines do not address calls by vLLM's request ids; send "
                '{"abort_all": true} to end every call in flight (finish_reason abort, tokens kept)',
                code="abort_by_id_not_supported",
            )
        if not body.abort_all:
            raise InvalidRequestError(
                "nothing to abort: give abort_all: true (request_ids are not supported)", param="abort_all"
            )
        await control_of(backend).pause_generation("abort")
        await control_of(backend).resume_generation()
        return {"status": "ok", "aborted": "all"}


def weight_sync_health(app: FastAPI) -> dict[str, Any]:
    """What ``/health`` adds: ``weight_transfer`` (the group, or None, and the last error) once a
    group was opened or a transfer failed, and ``sleep`` (``engine.sleep.sleep_status``) while the
    engine sleeps or waits for weights; nothing otherwise."""
    receiver = getattr(app.state, "weight_receiver", None)
    if receiver is None:
        return {}
    s = receiver.status()
    out: dict[str, Any] = {}
    from gymserve.engine.sleep import sleep_status

    sleeping = sleep_status(getattr(app.state.backend, "engine", None))
    if sleeping is not None and (sleeping["is_sleeping"] or sleeping["weights_released"]):
        out["sleep"] = sleeping
    if s["group"] is not None or s["transfers"] or s["failures"]:
        out["weight_transfer"] = {"group": s["group"], "last_error": s["last_error"], "in_progress": s["in_progress"]}
    return out
