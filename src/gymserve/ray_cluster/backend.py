"""``RayBackend``: route across N ``EngineReplica`` actors with the shared ``ReplicaPool``.

What Ray does and what gymserve does (Ray fault tolerance:
https://docs.ray.io/en/latest/ray-core/fault_tolerance/actors.html):

- Ray places each replica in its own placement-group bundle (CPUs, GPUs, memory, custom resources;
  https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html), so replicas are
  gang-scheduled across the cluster and a restarted replica comes back into its reserved bundle.
- ``max_restarts=-1``: Ray restarts a replica whose process or node dies, re-running its
  constructor (the model is loaded again). ``max_task_retries=0``: Ray never re-runs a call
  silently — an in-flight call to a dying replica fails with ``RayActorError`` (in Ray 2.x
  ``ActorUnavailableError`` while it restarts, ``ActorDiedError`` when it is gone for good), so the
  front end decides. Calls made while a replica is restarting are queued by Ray until it is back.
- gymserve: a new session is assigned round-robin among healthy replicas and sticks to its replica
  (``ReplicaPool``); a failed call marks the replica down, re-assigns the session, and is retried
  ONCE on the session's new replica. The request carries the whole conversation with its token
  fields, so the new replica re-prefills the exact same prompt token IDs (the prefix splice) —
  the retried call's training fields are as correct as the first try's would have been; only the
  KV cache is rebuilt. A background probe (``health()`` with a timeout) marks replicas up again
  and counts restarts (a new ``incarnation`` answering under the same name).
- Streaming goes through a Ray streaming generator; a replica that dies before the first chunk is
  failed over like a plain call, one that dies mid-stream ends the stream with an error event
  (chunks already sent cannot be taken back).

Errors: ``ImportError`` when ray is missing; ``UpstreamError`` (502) when the cluster cannot hold
the replicas or a replica fails to start; ``UpstreamConnectionError`` (502) when a call fails on two
replicas; the local backend's own errors (400s) pass through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.pool import Limiter, Replica, ReplicaPool
from gymserve.errors import EngineError, UpstreamConnectionError, UpstreamError
from gymserve.protocol import ChatCompletionDict, ChatRequest
from gymserve.ray_cluster.replica import EngineReplica, raise_remote_error

log = logging.getLogger("gymserve.ray")


@dataclass(eq=False)
class RayReplica(Replica):
    """A pool ``Replica`` whose ``client`` is a Ray actor handle; ``base_url`` holds its name.

    ``state``: ``starting`` | ``alive`` | ``restarting`` (unreachable, Ray restarting it) | ``dead``.
    """

    index: int = 0
    state: str = "starting"
    node: str | None = None
    node_id: str | None = None
    pid: int | None = None
    incarnation: str | None = None
    restarts: int = 0
    served: int = 0

    @property
    def name(self) -> str:
        return self.base_url

    def row(self) -> dict[str, Any]:
        """This replica's line in ``/health``."""
        row = {"name": self.name, "state": self.state, "healthy": self.healthy, "in_flight": self.in_flight,
               "sessions": self.sessions, "node": self.node, "node_id": self.node_id, "pid": self.pid,
               "restarts": self.restarts, "served": self.served}
        if self.last_error:
            row["last_error"] = self.last_error
        return row


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError('the ray backend needs Ray: pip install "gymserve[ray]" (or pip install ray) '
                          "on the front end and on every node of the cluster") from exc
    return ray


def connect_ray(config, **init_kwargs: Any) -> bool:
    """Connect this process to Ray as ``config`` (a ``RayBackendConfig``) says; True when gymserve
    made the connection (and so must end it). A Ray instance gymserve starts itself binds 127.0.0.1
    only. ``init_kwargs`` go to ``ray.init`` as they are (e.g. ``num_cpus`` for a local instance)."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": config.namespace, "include_dashboard": False, "log_to_driver": True,
                              **init_kwargs}
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

        return canonicalize_bootstrap_address(None) is None
    except Exception:  # noqa: BLE001 - private API; when unsure, let Ray pick its own address
        return False


class RayBackend(Backend):
    """N replicas of one model on a Ray cluster; see the module docstring.

    ``config``: a ``gymserve.config.RayBackendConfig``. ``max_queue``: requests allowed to wait
    beyond ``replicas * max_concurrent_requests`` in flight (429 beyond that).
    The constructor connects to Ray, reserves the resources and waits until every replica has
    loaded the model (``startup_timeout``), so a server never starts with a broken fleet.
    """

    name = "ray"

    def __init__(self, config, *, max_queue: int = 1024):
        ray = _import_ray()
        self.config = config
        self._owns_ray = connect_ray(config)
        self._closed = False
        self._pg = None
        self.replicas: list[RayReplica] = []
        try:
            self._start_replicas(ray)
        except BaseException:
            self._teardown(ray)
            raise
        self.pool = ReplicaPool(self.replicas, probe=self._probe, interval=config.health_check_interval)
        self.limiter = Limiter(config.replicas * config.max_concurrent_requests, max_queue, name="ray backend")
        log.info("ray backend: %d replicas of %s on %s", len(self.replicas), self.model_name,
                 sorted({r.node for r in self.replicas}))

    @classmethod
    def from_config(cls, config, *, max_queue: int = 1024) -> RayBackend:
        return cls(config, max_queue=max_queue)

    # ---- start-up and shutdown ----------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        res = self.config.replica_resources
        bundle = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
        if res.memory:
            bundle["memory"] = res.memory
        return {k: v for k, v in bundle.items() if v}

    def _start_replicas(self, ray) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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
                    "backend.replica_resources, or add nodes", code="insufficient_resources") from None
        actor_cls = ray.remote(EngineReplica)
        run = uuid.uuid4().hex[:8]
        local = cfg.local.model_dump(mode="json")
        for i in range(cfg.replicas):
            options: dict[str, Any] = {
                "name": f"gymserve-{run}-replica-{i}", "namespace": cfg.namespace, "max_restarts": -1, "max_task_retries": 0,
                "num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "max_concurrency": 10_000,
            }
            if res.memory:
                options["memory"] = res.memory
            if res.resources:
                options["resources"] = dict(res.resources)
            if cfg.runtime_env:  # per actor, so it applies also when joining a driver's existing connection
                options["runtime_env"] = dict(cfg.runtime_env)
            if self._pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i)
            handle = actor_cls.options(**options).remote(f"replica-{i}", local, res.num_cpus or 1.0)
            self.replicas.append(RayReplica(base_url=f"replica-{i}", client=handle, index=i))
        refs = [r.client.info.remote() for r in self.replicas]
        try:
            infos = ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise UpstreamError(f"the replicas did not load the model within {cfg.startup_timeout:.0f} s "
                                "(backend.startup_timeout)", code="replica_start_timeout") from None
        except ray.exceptions.RayError as exc:
            raise UpstreamError(f"a replica failed to start: {_cause(exc)}", code="replica_start_failed") from None
        for replica, info in zip(self.replicas, infos):
            self._update(replica, info)
        self.model_name = infos[0]["model"]
        self.description = {k: infos[0].get(k) for k in ("tool_call_parser", "reasoning_parser", "context_window")}

    def _teardown(self, ray) -> None:
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(replica.client, no_restart=True)
        if self._pg is not None:
            with contextlib.suppress(Exception):
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
        if self._owns_ray:
            # Ends this driver's connection; a Ray instance this process started stops with it.
            ray.shutdown()

    async def close(self) -> None:
        """Kill the replicas (no restart), free their bundles, and disconnect from Ray (stopping
        the local instance if gymserve started it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.pool.close()
        ray = _import_ray()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(r.client.shutdown.remote() for r in self.replicas),
                                                  return_exceptions=True), timeout=10)
        await asyncio.to_thread(self._teardown, ray)

    # ---- health -------------------------------------------------------------------------------

    def _update(self, replica: RayReplica, info: dict[str, Any]) -> None:
        if replica.incarnation is not None and info["incarnation"] != replica.incarnation:
            replica.restarts += 1
            log.warning("replica %s was restarted by Ray (now pid %s on %s)", replica.name, info["pid"], info["node_ip"])
        replica.incarnation, replica.pid = info["incarnation"], info["pid"]
        replica.node, replica.node_id = info.get("node_ip"), info.get("node_id")
        replica.state = "alive"

    async def _probe(self, replica: RayReplica) -> None:
        """``ReplicaPool`` probe: raises when the replica cannot answer within the timeout."""
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            info = await asyncio.wait_for(_awaitable(replica.client.health.remote()), self.config.health_check_timeout)
        except ActorDiedError:
            replica.state = "dead"
            raise
        except (RayActorError, asyncio.TimeoutError):
            replica.state = "restarting"
            raise
        self._update(replica, info)

    async def health(self) -> dict[str, Any]:
        """``{"status": ok|degraded|down, "backend": "ray", "model", "replicas": [{name, state,
        in_flight, sessions, node, restarts, ...}]}`` after probing every replica now."""
        await self.pool.check_all()
        status = self.pool.status()["status"]
        return {"status": status, **self.describe(), "replicas": [r.row() for r in self.replicas]}

    def describe(self) -> dict[str, Any]:
        """``{"backend": "ray", "target", "model", "tool_call_parser", "reasoning_parser", "context_window"}``."""
        where = self.config.ray_address or "a local Ray instance"
        return {"backend": "ray", "target": f"{len(self.replicas)} replicas on {where}", "model": self.model_name,
                **self.description}

    async def models(self) -> list[str]:
        return [self.model_name]

    # ---- calls --------------------------------------------------------------------------------

    def _failed(self, replica: RayReplica, exc: BaseException, session_id: str | None) -> RayReplica:
        """Mark ``replica`` down after ``exc`` and return where the session goes next."""
        from ray.exceptions import ActorDiedError

        replica.state = "dead" if isinstance(exc, ActorDiedError) else "restarting"
        self.pool.mark_down(replica, _cause(exc))
        nxt = self.pool.pick(session_id)
        log.warning("replica %s failed (%s); session %s retried on %s", replica.name, type(exc).__name__,
                    session_id, nxt.name)
        return nxt

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """One call on the session's replica; on replica failure, once more on its new replica."""
        from ray.exceptions import RayActorError, RayTaskError

        if request.get("stream"):
            request = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        async with self.limiter.slot():
            replica = self.pool.pick(ctx.session_id)
            for attempt in range(2):
                replica.in_flight += 1
                ref = replica.client.chat.remote(request, ctx.session_id, ctx.request_id)
                try:
                    result = await ref
                except asyncio.CancelledError:  # the client went away: stop generating on the replica
                    with contextlib.suppress(Exception):
                        _import_ray().cancel(ref)
                    raise
                except RayActorError as exc:  # the replica's process or node died (or is restarting)
                    error = exc
                except RayTaskError as exc:  # a gymserve bug or engine crash inside the replica
                    raise EngineError(f"replica {replica.name} failed: {_cause(exc)}") from None
                else:
                    replica.served += 1
                    return raise_remote_error(result)
                finally:
                    replica.in_flight -= 1
                if attempt:
                    raise UpstreamConnectionError(
                        f"the call failed on two replicas (last: {replica.name}, {_cause(error)}); "
                        "the cluster may be losing nodes", code="replica_failed")
                replica = self._failed(replica, error, ctx.session_id)
        raise AssertionError("unreachable")  # pragma: no cover

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Chat chunks from the session's replica (Ray streaming generator); see module docstring."""
        from ray.exceptions import RayActorError, RayTaskError

        ray = _import_ray()
        async with self.limiter.slot():
            replica = self.pool.pick(ctx.session_id)
            for attempt in range(2):
                gen = replica.client.chat_stream.options(num_returns="streaming").remote(
                    request, ctx.session_id, ctx.request_id)
                started = done = False
                replica.in_flight += 1
                try:
                    async for ref in gen:
                        chunk = raise_remote_error(await ref)
                        started = True
                        yield chunk
                    done = True
                    replica.served += 1
                    return
                except RayActorError as exc:
                    done = True  # the generator died with its replica
                    if started or attempt:
                        raise UpstreamConnectionError(
                            f"replica {replica.name} failed during the stream ({_cause(exc)}); retry the call",
                            code="replica_failed") from None
                    error = exc
                except RayTaskError as exc:
                    done = True
                    raise EngineError(f"replica {replica.name} failed: {_cause(exc)}") from None
                finally:
                    replica.in_flight -= 1
                    if not done:  # client went away or a request error: stop the replica's generator
                        with contextlib.suppress(Exception):
                            ray.cancel(gen)
                replica = self._failed(replica, error, ctx.session_id)

    async def served_sessions(self) -> dict[str, dict[str, int]]:
        """``{replica name: {session_id: calls}}`` as each live replica process reports it (tests,
        debugging); replicas that do not answer within the probe timeout are left out."""
        out: dict[str, dict[str, int]] = {}
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                out[replica.name] = await asyncio.wait_for(
                    _awaitable(replica.client.served_sessions.remote()), self.config.health_check_timeout)
        return out


def _brief(resources: dict[str, float]) -> dict[str, float]:
    """Resources without Ray's per-node and object-store bookkeeping keys."""
    return {k: v for k, v in sorted(resources.items()) if not k.startswith("node:") and k != "object_store_memory"}


async def _awaitable(ref):
    return await ref


def _cause(exc: BaseException) -> str:
    """A one-line reason from a Ray exception: the original exception's line when Ray carries a
    traceback (a replica's constructor or method raised), else the first line of Ray's message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    if any(ln.startswith('File "') for ln in lines):
        return lines[-1][:500]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
