"""The Ray side of a ray backend: the connection, one placement group, the replica actors.

``ReplicaFleet(config)`` connects (``connect_ray``), ``start()`` reserves one bundle per replica,
starts the ``EngineReplica`` actors and waits until each has loaded the model; ``teardown()`` undoes
all of it. ``RayReplica`` is one actor as the front end's ``ReplicaPool`` sees it. Routing calls to
the replicas is ``backend.RayBackend``'s job; nothing here answers a request.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gymserve.backends.pool import Replica
from gymserve.errors import UpstreamError
from gymserve.ray_cluster.replica import EngineReplica


@dataclass(eq=False)
class RayReplica(Replica):
    """A pool ``Replica`` whose ``client`` is a Ray actor handle; ``base_url`` holds its name.

    ``state``: ``starting`` | ``alive`` | ``restarting`` (unreachable, Ray restarting it) | ``dead``.
    ``weight_version`` … ``lora_adapter``: its control status as last reported (``control``).
    """

    index: int = 0
    state: str = "starting"
    node: str | None = None
    node_id: str | None = None
    pid: int | None = None
    incarnation: str | None = None
    restarts: int = 0
    served: int = 0
    weight_version: Any = None
    weight_updates: int = 0
    paused: str | None = None
    lora_adapter: str | None = None

    @property
    def name(self) -> str:
        return self.base_url

    def row(self) -> dict[str, Any]:
        """This replica's line in ``/health``."""
        row = {
            "name": self.name,
            "state": self.state,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "sessions": self.sessions,
            "node": self.node,
            "node_id": self.node_id,
            "pid": self.pid,
            "restarts": self.restarts,
            "served": self.served,
            "weight_version": self.weight_version,
            "paused": self.paused,
        }
        if self.last_error:
            row["last_error"] = self.last_error
        return row


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            'the ray backend needs Ray: pip install "gymserve[ray]" (or pip install ray) '
            "on the front end and on every node of the cluster"
        ) from exc
    return ray


def connect_ray(config, **init_kwargs: Any) -> bool:
    """Connect this process to Ray as ``config`` (a ``RayBackendConfig``) says; True when gymserve
    made the connection (and so must end it). A Ray instance gymserve starts itself binds 127.0.0.1
    only. ``init_kwargs`` go to ``ray.init`` as they are (e.g. ``num_cpus`` for a local instance)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {
        "namespace": config.namespace,
        "include_dashboard": False,
        "log_to_driver": True,
        **init_kwargs,
    }
    address = config.ray_address
    if address in (None, "local") and _no_running_cluster(address):
        if config.object_store_memory:
            kwargs["object_store_memory"] = config.object_store_memory
        with _loopback_only():
            ray.init(address=address, **kwargs)
    else:
        ray.init(address=address, **kwargs)
    return True


@contextlib.contextmanager
def _loopback_only():
    """Make a Ray instance started here listen on 127.0.0.1 only.

    A private single-node instance needs no outside reachability; by default Ray advertises (and
    its gRPC servers bind) the machine's routable address. Ray's own switch for loopback-only nodes
    is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read into ``ray_constants.ENABLE_RAY_CLUSTER``, a
    private constant, hence the best-effort patch); both are restored after start-up.
    """
    import os

    env = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    old_env = os.environ.get(env)
    try:
        from ray._private import ray_constants
    except Exception:  # noqa: BLE001 - private module moved: fall back to Ray's default binding
        ray_constants = None
    old_flag = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[env] = "0"
    if ray_constants is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = old_env
        if ray_constants is not None and old_flag is not None:
            ray_constants.ENABLE_RAY_CLUSTER = old_flag


def _no_running_cluster(address: str | None) -> bool:
    """True when ``ray.init(address)`` will start a new instance rather than join one."""
    if address == "local":
        return True
    try:
        from ray._private.services import canonicalize_bootstrap_address

        # Ray annotates addr as str, but its docstring and code take None (read RAY_ADDRESS/the last cluster).
        return canonicalize_bootstrap_address(None) is None  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - private API; when unsure, let Ray pick its own address
        return False


class ReplicaFleet:
    """``config.replicas`` actors of one model (``config``: a ``RayBackendConfig``); see the module
    docstring. ``replicas`` is filled by :meth:`start`. Raises ``ImportError`` when ray is missing."""

    def __init__(self, config) -> None:
        self._ray = import_ray()
        self.config = config
        self._owns_ray = connect_ray(config)
        self._pg: Any = None
        self.replicas: list[RayReplica] = []

    def _bundle(self) -> dict[str, float]:
        res = self.config.replica_resources
        bundle = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
        if res.memory:
            bundle["memory"] = res.memory
        return {k: v for k, v in bundle.items() if v}

    def start(self) -> list[dict[str, Any]]:
        """Reserve the bundles, start the actors and wait until each has loaded the model; returns
        each replica's ``info()``. Raises ``UpstreamError`` (insufficient resources, start timeout,
        a replica that failed to start); the caller then calls :meth:`teardown`."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        cfg, res = self.config, self.config.replica_resources
        bundle = self._bundle()
        deadline = time.monotonic() + cfg.startup_timeout
        if bundle:  # an all-zero bundle is invalid in Ray; such replicas are scheduled anywhere
            self._pg = placement_group([dict(bundle) for _ in range(cfg.replicas)], strategy=cfg.placement_strategy)
            try:
                ray.get(self._pg.ready(), timeout=cfg.startup_timeout)
            except ray.exceptions.GetTimeoutError:
                raise UpstreamError(
                    f"the Ray cluster cannot hold {cfg.replicas} replicas of {bundle} each "
                    f"({cfg.placement_strategy}) within {cfg.startup_timeout:.0f} s; it has "
                    f"{_brief(ray.available_resources())} free of {_brief(ray.cluster_resources())}. Lower backend.replicas or "
                    "backend.replica_resources, or add nodes",
                    code="insufficient_resources",
                ) from None
        actor_cls = ray.remote(EngineReplica)
        run = uuid.uuid4().hex[:8]
        local = cfg.local.model_dump(mode="json")
        for i in range(cfg.replicas):
            options: dict[str, Any] = {
                "name": f"gymserve-{run}-replica-{i}",
                "namespace": cfg.namespace,
                "max_restarts": -1,
                "max_task_retries": 0,
                "num_cpus": res.num_cpus,
                "num_gpus": res.num_gpus,
                "max_concurrency": 10_000,
            }
            if res.memory:
                options["memory"] = res.memory
            if res.resources:
                options["resources"] = dict(res.resources)
            if cfg.runtime_env:  # per actor, so it applies also when joining a driver's existing connection
                options["runtime_env"] = dict(cfg.runtime_env)
            if self._pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i
                )
            handle = actor_cls.options(**options).remote(f"replica-{i}", local, res.num_cpus or 1.0)
            self.replicas.append(RayReplica(base_url=f"replica-{i}", client=handle, index=i))
        refs = [r.client.info.remote() for r in self.replicas]
        try:
            infos = ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise UpstreamError(
                f"the replicas did not load the model within {cfg.startup_timeout:.0f} s (backend.startup_timeout)",
                code="replica_start_timeout",
            ) from None
        except ray.exceptions.RayError as exc:
            raise UpstreamError(
                f"a replica failed to start: {failure_reason(exc)}", code="replica_start_failed"
            ) from None
        return infos

    def teardown(self) -> None:
        """Kill the actors (no restart), remove the placement group and end the connection if this
        fleet made it (a Ray instance this process started stops with it). Blocking; idempotent."""
        ray = self._ray
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(replica.client, no_restart=True)
        if self._pg is not None:
            with contextlib.suppress(Exception):
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
        self._pg = None
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


def _brief(resources: dict[str, float]) -> dict[str, float]:
    """Resources without Ray's per-node and object-store bookkeeping keys."""
    return {k: v for k, v in sorted(resources.items()) if not k.startswith("node:") and k != "object_store_memory"}


def failure_reason(exc: BaseException) -> str:
    """A one-line reason from a Ray exception: the original exception's line when Ray carries a
    traceback (a replica's constructor or method raised), else the first line of Ray's message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    if any(ln.startswith('File "') for ln in lines):
        return lines[-1][:500]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
