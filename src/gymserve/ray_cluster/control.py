"""The control plane of a fleet of Ray replicas: pause all, update all or none, one version.

What a trainer gets (``RayBackend.control``, a ``gymserve.control.Control``; vLLM's names, served
by ``server.control_routes`` like the local backend's):

- **Pause and resume.** The front end's ``PauseGate`` holds new calls (so none starts on a fleet
  in the middle of a change), and every replica's engine pauses in the same mode (``abort``: its
  calls end as aborted answers that keep their tokens; ``wait``: they finish; ``keep``: they freeze
  and continue after resume), so the modes mean exactly what they mean on one local backend.
- **All or none.** A weight change — ``update_weights`` (a directory, in-process tensors, or an
  object in Ray's object store), ``update_weight_version``, a LoRA load or unload — is one
  transaction: the replicas are paused (``keep``, unless the trainer paused them already), each
  applies the change keeping what undoes it (``replica_control``), and then either every replica
  commits, or — when any of them refused or died — the ones that applied it roll back, bit for bit,
  to the version before, and the error says which replica failed and why. Resumed either way, every
  replica serves one version.
- **One version per call.** The front end names the versions (the trainer's ``weight_version``, or
  its own count of changes) so that all replicas agree, and routes a call only to replicas on the
  fleet's version. A call *starts on* the fleet's version when the front end admits it (calls wait
  at the door while the fleet is paused or changing, so that is the version of its first token);
  its failover retry (``backend``: a replica dying mid-call) goes only to a replica on that same
  version, and when no such replica is left — the fleet moved on since — the call fails with 502
  ``version_unavailable`` instead of being answered by other weights.
- **Restarted replicas.** Ray restarts a dead replica with the original weights. The probe sees its
  version differ from the fleet's; the front end routes nothing to it, copies a healthy replica's
  served state into it (``export_weights`` → object store → ``import_weights``), then routes to it
  again. A replica that is down during a change is brought up to date the same way when it returns.
- **Observability.** ``control_status()`` lists every replica's version, updates and pause state:
  ``/health`` shows it (``replicas_control``, and ``weight_version`` on each replica's row) and
  ``/metrics`` exports it per replica (``server.control_routes``).

Errors: what a replica refused passes through with its status (400 ``invalid_weights`` naming the
tensor, 404, 409...) and the replica's name in the message; a replica that died during a change
gives 502 ``replica_failed``; a replica that cannot undo its change (an engine without
``restore_weights``) gives 502 ``rollback_failed`` and is taken out of routing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

from gymserve.control import Control, check_mode, check_timeout, check_version
from gymserve.engine.base import PauseMode, WeightVersion
from gymserve.engine.pause_gate import PauseGate
from gymserve.errors import GymserveError, UpstreamConnectionError, UpstreamError
from gymserve.ray_cluster.fleet import RayReplica, failure_reason, import_ray
from gymserve.ray_cluster.replica import raise_remote_error

log = logging.getLogger("gymserve.ray")


class FleetControl(Control):
    """``RayBackend.control``; see the module docstring. Built from the backend's ``replicas`` and
    ``config`` (a ``RayBackendConfig``) and the replicas' first ``info()`` answers (``infos``).
    The backend's calls are admitted through ``gate`` and routed with ``serves``."""

    def __init__(self, replicas: list[RayReplica], config: Any, infos: list[dict[str, Any]], max_queue: int):
        super().__init__("ray")
        self.replicas = replicas
        self.config = config
        self.gate = PauseGate(
            name="the ray backend", default_timeout=float(self.config.local.pause_timeout), max_queue=max_queue
        )
        first = infos[0].get("control") or {}
        self.fleet_version: WeightVersion = first.get("weight_version", 0)
        self.fleet_updates = 0
        self._change_lock = asyncio.Lock()
        self._syncing: dict[str, asyncio.Task] = {}
        for replica, info in zip(self.replicas, infos):
            self.track(replica, info)

    # ---- versions and routing -------------------------------------------------------------------

    def serves(self, version: WeightVersion):
        """The ``ReplicaPool.pick`` filter: replicas on ``version`` and not being brought up to date."""
        return lambda r: r.weight_version == version and r.name not in self._syncing

    def no_replica_error(self, version: WeightVersion, *, failed: str | None = None) -> UpstreamConnectionError:
        """The 502 a call gets when no replica serves ``version`` (its start version)."""
        if failed is None:
            return UpstreamConnectionError(
                f"no replica serves weight version {version!r} now: "
                f"{', '.join(f'{r.name} is on {r.weight_version!r}' for r in self.replicas)}; replicas Ray "
                "restarted are being brought up to date, retry shortly",
                code="version_unavailable",
            )
        return UpstreamConnectionError(
            f"{failed} and no other replica serves weight version {version!r}, the version this call started "
            f"on (the fleet serves {self.fleet_version!r} now); the call was not retried on other weights. "
            "Retry the call",
            code="version_unavailable",
        )

    def track(self, replica: RayReplica, info: dict[str, Any]) -> None:
        """Record a replica's control status from its ``info()``; start bringing it up to date when
        it is alive on another version than the fleet's (Ray restarted it, or it missed a change)."""
        control = info.get("control")
        if not isinstance(control, dict) or "weight_version" not in control:
            replica.weight_version = self.fleet_version  # an engine without versions: it serves the fleet's
            return
        replica.weight_version = control.get("weight_version")
        replica.weight_updates = int(control.get("weight_updates") or 0)
        replica.paused = control.get("paused")
        replica.lora_adapter = control.get("lora_adapter")
        if (
            replica.weight_version != self.fleet_version
            and replica.state == "alive"
            and replica.name not in self._syncing
        ):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            log.warning(
                "replica %s serves weight version %r, the fleet %r: routing nothing to it until it is brought up to date",
                replica.name,
                replica.weight_version,
                self.fleet_version,
            )
            self._syncing[replica.name] = loop.create_task(self._sync(replica), name=f"gymserve-sync-{replica.name}")

    async def _sync(self, replica: RayReplica) -> None:
        """Copy a replica on the fleet's version into ``replica`` (see the module docstring)."""
        try:
            async with self._change_lock:
                source = next(
                    (r for r in self.replicas if r is not replica and self.serves(self.fleet_version)(r) and r.healthy),
                    None,
                )
                if source is None:
                    log.error(
                        "replica %s cannot be brought up to date: no replica serves version %r",
                        replica.name,
                        self.fleet_version,
                    )
                    return
                state = source.client.export_weights.remote()
                result = raise_remote_error(await replica.client.import_weights.remote(state))
                replica.weight_version = result["weight_version"]
                if self.gate.paused:  # a replica joining a paused fleet pauses with it
                    await replica.client.pause_generation.remote(self.gate.paused, self.gate.seconds_left() or None)
                log.info(
                    "replica %s now serves weight version %r (copied from %s)",
                    replica.name,
                    replica.weight_version,
                    source.name,
                )
        except Exception as exc:  # noqa: BLE001 - the replica stays out of routing; the next probe retries
            log.error("bringing replica %s up to date failed: %s", replica.name, failure_reason(exc))
        finally:
            self._syncing.pop(replica.name, None)

    def control_status(self) -> list[dict[str, Any]]:
        """Per replica ``{"replica", "weight_version", "weight_updates", "paused", "lora_adapter",
        "routable"}`` (``routable``: on the fleet's version, so it takes calls)."""
        return [
            {
                "replica": r.name,
                "weight_version": r.weight_version,
                "weight_updates": r.weight_updates,
                "paused": r.paused,
                "pause_seconds_left": self.gate.seconds_left(),
                "lora_adapter": r.lora_adapter,
                "routable": self.serves(self.fleet_version)(r),
            }
            for r in self.replicas
        ]

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The adapter the fleet has merged (``[{"name"}]``), as its routable replicas report it."""
        names = {r.lora_adapter for r in self.replicas if self.serves(self.fleet_version)(r) and r.lora_adapter}
        return [{"name": n} for n in sorted(names)]

    async def close(self) -> None:
        """Release the calls held at the gate and stop bringing replicas up to date."""
        self.gate.close()
        for task in list(self._syncing.values()):
            task.cancel()

    # ---- pause ----------------------------------------------------------------------------------

    async def _each(self, method: str, *args: Any, targets: list[RayReplica] | None = None) -> list[Any]:
        """``method(*args)`` on every live replica (or ``targets``) at once: results or exceptions."""
        targets = [r for r in self.replicas if r.state == "alive"] if targets is None else targets

        async def one(r: RayReplica) -> Any:
            return raise_remote_error(await getattr(r.client, method).remote(*args))

        return list(await asyncio.gather(*(one(r) for r in targets), return_exceptions=True))

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """Hold new calls at the front end and pause every replica's engine in ``mode`` (see the
        module docstring); returns when every replica's pause took effect. Raises the first
        replica's error (e.g. 409 ``pause_ended`` for a ``wait`` pause past its deadline)."""
        mode = check_mode(mode)
        timeout = None if timeout is None else check_timeout(timeout)
        await self.gate.pause(mode, timeout, abort_in_flight=False, drain=False)
        results = await self._each("pause_generation", mode, timeout or self.gate.timeout)
        for r in self.replicas:
            r.paused = mode
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            raise _as_gymserve(errors[0])

    async def resume_generation(self) -> None:
        """Resume every replica, then let the calls held at the front end go."""
        await self._each("resume_generation")
        for r in self.replicas:
            r.paused = None
        self.gate.resume()

    async def is_paused(self) -> bool:
        return self.gate.paused is not None

    # ---- weight changes -------------------------------------------------------------------------

    async def update_weights(
        self, tensors: Any = None, *, path: str | os.PathLike | None = None, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Swap new weights into every replica, all or none; returns the new version. ``tensors``:
        a state dict (put once into Ray's object store and handed to every replica by reference),
        or an ``ObjectRef`` to one the driver put there itself (``ray.put(state_dict)``); ``path``:
        safetensors on every replica's machine (``engine.weights``)."""
        ray = import_ray()
        ref = tensors
        if tensors is not None and not isinstance(tensors, ray.ObjectRef):
            if not isinstance(tensors, Mapping):
                from gymserve.errors import WeightUpdateError

                raise WeightUpdateError(
                    f"tensors must be a state dict (name → torch.Tensor) or a ray.ObjectRef to one, got {type(tensors).__name__}"
                )
            ref = await asyncio.to_thread(ray.put, dict(tensors))
        kwargs: dict[str, Any] = {} if path is None else {"path": str(path)}
        return await self._change("update_weights", kwargs, weight_version, tensors=ref)

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        """Name the weights every replica serves ``new_version`` (all or none)."""
        version = check_version(new_version, "new_version")
        await self._change("update_weight_version", {"new_version": version}, version)

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: Any = None,
        *,
        tensors: Mapping[str, Any] | None = None,
        config: Any = None,
        load_inplace: bool = False,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Merge a LoRA adapter on every replica (``engine.lora``), all or none."""
        kwargs: dict[str, Any] = {"lora_name": lora_name, "load_inplace": load_inplace}
        if lora_path is not None:
            kwargs["lora_path"] = str(lora_path)
        if config is not None:
            kwargs["config"] = config
        ref = None if tensors is None else await asyncio.to_thread(import_ray().put, dict(tensors))
        return await self._change("load_lora_adapter", kwargs, weight_version, tensors=ref)

    async def unload_lora_adapter(
        self, lora_name: str, *, weight_version: WeightVersion | None = None
    ) -> WeightVersion:
        """Restore the base weights on every replica, all or none."""
        return await self._change("unload_lora_adapter", {"lora_name": lora_name}, weight_version)

    async def _change(
        self, op: str, kwargs: dict[str, Any], weight_version: WeightVersion | None, *, tensors: Any = None
    ) -> WeightVersion:
        """One all-or-none transaction of ``op`` over the replicas on the fleet's version."""
        async with self._change_lock:
            version = self.fleet_updates + 1 if weight_version is None else check_version(weight_version)
            if op != "update_weight_version":
                kwargs = {**kwargs, "weight_version": version}
            paused_here = self.gate.paused is None
            try:
                if paused_here:
                    await self.pause_generation("keep")
                return await self._apply_everywhere(op, kwargs, version, tensors)
            finally:
                if paused_here:
                    await self.resume_generation()

    async def _apply_everywhere(
        self, op: str, kwargs: dict[str, Any], version: WeightVersion, tensors: Any
    ) -> WeightVersion:
        targets = [r for r in self.replicas if r.state == "alive" and self.serves(self.fleet_version)(r)]
        if not targets:
            raise UpstreamError(
                f"{op} refused: no replica is up on the fleet's weight version {self.fleet_version!r}",
                code="replica_failed",
            )
        txn = uuid.uuid4().hex
        results = await asyncio.gather(
            *(_call(r, "apply", txn, op, tensors, kwargs) for r in targets), return_exceptions=True
        )
        failed = [(r, e) for r, e in zip(targets, results) if isinstance(e, BaseException)]
        applied = [r for r, e in zip(targets, results) if not isinstance(e, BaseException)]
        if failed:
            undone = await asyncio.gather(*(_call(r, "rollback", txn) for r in applied), return_exceptions=True)
            stuck = []
            for r, res in zip(applied, undone):
                if isinstance(res, BaseException):
                    stuck.append(r)
                    r.weight_version = version  # it kept the change: never routed to while the fleet is on the old one
                    log.error("replica %s could not undo %s: %s", r.name, op, failure_reason(res))
            raise _fleet_error(op, failed, applied, stuck, self.fleet_version)
        await asyncio.gather(*(_call(r, "commit", txn) for r in targets), return_exceptions=True)
        for r in targets:
            r.weight_version = version
            r.weight_updates += 1
        self.fleet_version, self.fleet_updates = version, self.fleet_updates + 1
        for r in self.replicas:
            if r not in targets:
                log.warning("replica %s was down during %s; it is brought up to date when it is back", r.name, op)
        return version


async def _call(replica: RayReplica, method: str, *args: Any) -> Any:
    return raise_remote_error(await getattr(replica.client, method).remote(*args))


def _as_gymserve(exc: BaseException) -> GymserveError:
    if isinstance(exc, GymserveError):
        return exc
    return UpstreamConnectionError(f"a replica failed: {failure_reason(exc)}", code="replica_failed")


def _fleet_error(
    op: str,
    failed: list[tuple[RayReplica, BaseException]],
    applied: list[RayReplica],
    stuck: list[RayReplica],
    version: WeightVersion,
) -> GymserveError:
    """The error of a change that failed on ``failed`` replicas: the first replica's own error
    (its class and status: 400 for a refused update), its message naming the replica and saying
    what became of the others."""
    first_replica, first = failed[0]
    names = ", ".join(r.name for r, _ in failed)
    if stuck:
        return UpstreamError(
            f"{op} failed on {names} ({_reason(first)}) and could not be undone on "
            f"{', '.join(r.name for r in stuck)}, which are taken out of routing; the others serve version {version!r}",
            code="rollback_failed",
        )
    after = (
        f"undone on {', '.join(r.name for r in applied)}, so every replica still serves version {version!r}"
        if applied
        else f"nothing changed, every replica still serves version {version!r}"
    )
    if isinstance(first, GymserveError):
        first.message = f"{first_replica.name}: {first.message} ({op} {after})"
        first.args = (first.message,)
        return first
    return UpstreamConnectionError(
        f"{op} failed: replica {names} died during it ({_reason(first)}); {after}", code="replica_failed"
    )


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, GymserveError) else failure_reason(exc)
