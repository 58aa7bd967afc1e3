"""The control plane of one replica actor, as the front end's fleet operations need it.

Every method answers a value or an ``error_payload`` (a ``GymserveError`` travels as a value, see
``replica``), never raises, so the front end tells a refused update (the error) from a dead replica
(Ray's ``RayActorError``).

A weight change (``update_weights``, ``update_weight_version``, a LoRA load or unload) runs as one
step of a fleet *transaction* named ``txn``: the replica keeps what it needs to undo it — the
values the update overwrote (``engine.control.UndoLog``), the version before, the LoRA adapter
state — until the front end says ``commit(txn)`` (every replica succeeded: drop it) or
``rollback(txn)`` (another replica failed: put it all back, bit for bit, under the old version).

``update_weights(txn, tensors, ...)`` takes ``tensors`` as a top-level argument, so when the front
end passes an ``ObjectRef`` (the driver's ``ray.put(state_dict)``), Ray hands every replica the
object from its object store by reference — one copy in the store, read where it is needed
(https://docs.ray.io/en/latest/ray-core/objects.html#passing-object-arguments).

``export_weights`` / ``import_weights`` copy one replica's whole served state (weights, version,
merged LoRA adapter) into another: how the front end brings a replica that Ray restarted (which
loaded the original weights again) up to the fleet's version before routing calls to it.
"""

from __future__ import annotations

import asyncio
from typing import Any

_OPS = ("update_weights", "update_weight_version", "load_lora_adapter", "unload_lora_adapter")


class ReplicaControl:
    """Mixed into ``replica.EngineReplica`` (which sets ``self.backend``, a ``LocalBackend``)."""

    backend: Any

    @property
    def _engine(self) -> Any:
        return self.backend.engine

    def _txns(self) -> dict[str, tuple[Any, Any, Any]]:
        txns = self.__dict__.get("_open_txns")
        if txns is None:
            txns = self.__dict__["_open_txns"] = {}
        return txns

    async def control_status(self) -> dict[str, Any]:
        """The engine's ``control_status()`` (``weight_version``, ``weight_updates``, ``paused``...)."""
        return getattr(self.backend.engine, "control_status", dict)()

    async def pause_generation(self, mode: str, timeout: float | None = None) -> Any:
        """The engine's pause (``engine.control``); ``{"paused": mode}`` or an error payload."""
        return await _answer(self.backend.control.pause_generation(mode, timeout=timeout), {"paused": mode})

    async def resume_generation(self) -> Any:
        return await _answer(self.backend.control.resume_generation(), {"paused": None})

    async def apply(self, txn: str, op: str, tensors: Any = None, kwargs: dict[str, Any] | None = None) -> Any:
        """Run the weight change ``op`` (one of ``update_weights``, ``update_weight_version``,
        ``load_lora_adapter``, ``unload_lora_adapter``; ``kwargs`` are its keyword arguments,
        ``tensors`` its state dict) keeping what undoes it under ``txn``. Returns
        ``{"weight_version": v}`` or an error payload (then nothing changed on this replica)."""
        from gymserve.engine.control import recording_undo
        from gymserve.errors import GymserveError, InvalidRequestError

        if op not in _OPS:
            return error_payload(InvalidRequestError(f"unknown control operation {op!r}"))
        kwargs = dict(kwargs or {})
        if tensors is not None:
            kwargs["tensors"] = tensors
        engine = self._engine
        before = engine.weight_version
        lora = engine.lora_snapshot() if hasattr(engine, "lora_snapshot") else None
        try:
            with recording_undo() as undo:
                if op == "update_weight_version":
                    await self.backend.control.update_weight_version(kwargs["new_version"])
                    version = kwargs["new_version"]
                else:
                    version = await getattr(self.backend.control, op)(**kwargs)
        except GymserveError as exc:
            return error_payload(exc)
        self._txns()[txn] = (undo, before, lora)
        return {"weight_version": version}

    async def commit(self, txn: str) -> None:
        """Every replica took the change: forget how to undo it."""
        self._txns().pop(txn, None)

    async def rollback(self, txn: str) -> Any:
        """Undo ``txn``'s change: the overwritten values, the LoRA adapter state and the version
        before it. ``{"weight_version": v}`` or an error payload (an engine without ``restore_weights``)."""
        from gymserve.errors import GymserveError, NotSupportedError

        entry = self._txns().pop(txn, None)
        if entry is None:
            return {"weight_version": self._engine.weight_version}
        undo, before, lora = entry
        engine = self._engine
        if not hasattr(engine, "restore_weights"):
            return error_payload(
                NotSupportedError(
                    f"the {getattr(engine, 'engine_name', 'this')} engine cannot undo a weight update, so this "
                    "replica keeps the new weights while the others went back",
                    code="rollback_not_supported",
                )
            )
        try:
            if lora is not None:
                engine.restore_lora_snapshot(lora)
            return {"weight_version": await engine.restore_weights(undo, before)}
        except GymserveError as exc:
            return error_payload(exc)

    async def export_weights(self) -> dict[str, Any]:
        """``{"tensors": state dict (CPU), "weight_version", "lora": the LoRA adapter state}``."""
        engine = self._engine
        state = await asyncio.to_thread(_copy_state, engine.model)
        lora = engine.lora_snapshot() if hasattr(engine, "lora_snapshot") else None
        return {"tensors": state, "weight_version": engine.weight_version, "lora": lora}

    async def import_weights(self, state: dict[str, Any]) -> Any:
        """Serve ``state`` (another replica's ``export_weights``): its weights, version and LoRA
        adapter state. ``{"weight_version": v}`` or an error payload."""
        from gymserve.engine.control import WorkerControl
        from gymserve.errors import GymserveError

        engine = self._engine
        try:
            # WorkerControl's own update: the LoRA engine refuses full updates while an adapter is
            # merged, but here the adapter state is replaced along with the weights.
            version = await WorkerControl.update_weights(
                engine, state["tensors"], weight_version=state["weight_version"]
            )
        except GymserveError as exc:
            return error_payload(exc)
        if state.get("lora") is not None and hasattr(engine, "restore_lora_snapshot"):
            engine.restore_lora_snapshot(state["lora"])
        return {"weight_version": version}


def _copy_state(model: Any) -> dict[str, Any]:
    """A CPU copy of ``model.state_dict()`` in which tied tensors stay one tensor (one copy to ship)."""
    copies: dict[tuple, Any] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in copies:
            copies[key] = t.detach().cpu().clone()
        out[name] = copies[key]
    return out


def error_payload(exc: BaseException) -> dict[str, Any]:
    # replica.py imports this module; its error_payload is imported when first needed.
    from gymserve.ray_cluster.replica import error_payload as payload

    return payload(exc)


async def _answer(work: Any, ok: Any) -> Any:
    from gymserve.errors import GymserveError

    try:
        await work
    except GymserveError as exc:
        return error_payload(exc)
    return ok
