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
  ONCE on the session's new replica — one on the weight version the call started on (``control``:
  a call is never answered by other weights than the ones it started on). The request carries the
  whole conversation with its token fields, so the new replica re-prefills the exact same prompt
  token IDs (the prefix splice) — the retried call's training fields are as correct as the first
  try's would have been; only the KV cache is rebuilt. A background probe (``health()`` with a
  timeout) marks replicas up again and counts restarts (a new ``incarnation`` answering under the
  same name).
- Streaming goes through a Ray streaming generator; a replica that dies before the first chunk is
  failed over like a plain call, one that dies mid-stream ends the stream with an error event
  (chunks already sent cannot be taken back).

Starting and stopping the actors is ``fleet.ReplicaFleet``'s. Errors: ``ImportError`` when ray is missing; ``UpstreamError`` (502) when the cluster cannot hold
the replicas or a replica fails to start; ``UpstreamConnectionError`` (502) when a call fails on two
replicas; the local backend's own errors (400s) pass through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from gymserve.backends.base import Backend, RequestContext
from gymserve.backends.local.request import echo_pinned_sampling
from gymserve.backends.pool import Limiter, ReplicaPool
from gymserve.backends.responses_over_chat import ChatAnswer
from gymserve.errors import EngineError, UpstreamConnectionError
from gymserve.protocol import ChatCompletionDict, ChatRequest, ResponsesRequest
from gymserve.ray_cluster.control import FleetControl
from gymserve.ray_cluster.fleet import RayReplica, ReplicaFleet, failure_reason, import_ray
from gymserve.ray_cluster.replica import raise_remote_error

log = logging.getLogger("gymserve.ray")


class RayBackend(FleetControl, Backend):
    """N replicas of one model on a Ray cluster; see the module docstring.

    ``config``: a ``gymserve.config.RayBackendConfig``. ``max_queue``: requests allowed to wait
    beyond ``replicas * max_concurrent_requests`` in flight (429 beyond that). The Responses API
    runs through ``responses_over_chat`` on the replicas' chunks (``answer``), with the pinned
    sampling params echoed, so a Response is the one a single local backend gives for the same tokens.
    The control plane (pause, all-or-none weight changes, one version per call) is
    ``control.FleetControl``'s.
    """

    name = "ray"
    limiter: Limiter

    def __init__(
        self,
        config,
        replicas: list[RayReplica],
        infos: list[dict[str, Any]],
        *,
        max_queue: int = 1024,
        release: Callable[[], None] | None = None,
    ):
        """Route across started ``replicas`` (their ``info()`` answers in ``infos``); ``release``
        (blocking) frees what holds them when the backend closes. ``from_config`` starts them."""
        self.config = config
        self.replicas = replicas
        self._release = release
        self._closed = False
        for replica, info in zip(replicas, infos):
            self._update(replica, info)
        self.model_name = infos[0]["model"]
        self.description = {k: infos[0].get(k) for k in ("tool_call_parser", "reasoning_parser", "context_window")}
        self.pool = ReplicaPool(replicas, probe=self._probe, interval=config.health_check_interval)
        self.limiter = Limiter(config.replicas * config.max_concurrent_requests, max_queue, name="ray backend")
        self._init_control(infos, max_queue)
        log.info(
            "ray backend: %d replicas of %s on %s",
            len(replicas),
            self.model_name,
            sorted({str(r.node) for r in replicas}),
        )

    @classmethod
    def from_config(cls, config, *, max_queue: int = 1024) -> RayBackend:
        """Connect to Ray, reserve the resources and wait until every replica has loaded the model
        (``startup_timeout``), so a server never starts with a broken fleet (``fleet.ReplicaFleet``)."""
        fleet = ReplicaFleet(config)
        try:
            infos = fleet.start()
        except BaseException:
            fleet.teardown()
            raise
        return cls(config, fleet.replicas, infos, max_queue=max_queue, release=fleet.teardown)

    async def close(self) -> None:
        """Stop the replicas' engines, then release the fleet (kill the actors, free their bundles,
        disconnect from Ray, stopping the local instance if gymserve started it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.gate.close()
        for task in list(self._syncing.values()):
            task.cancel()
        await self.pool.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(r.client.shutdown.remote() for r in self.replicas), return_exceptions=True), timeout=10
            )
        if self._release is not None:
            await asyncio.to_thread(self._release)

    # ---- health -------------------------------------------------------------------------------

    def _update(self, replica: RayReplica, info: dict[str, Any]) -> None:
        if replica.incarnation is not None and info["incarnation"] != replica.incarnation:
            replica.restarts += 1
            log.warning(
                "replica %s was restarted by Ray (now pid %s on %s)", replica.name, info["pid"], info["node_ip"]
            )
        replica.incarnation, replica.pid = info["incarnation"], info["pid"]
        replica.node, replica.node_id = info.get("node_ip"), info.get("node_id")
        replica.state = "alive"
        if hasattr(self, "gate"):  # after start-up; __init__ tracks versions once the fleet's is known
            self._track(replica, info)

    async def _probe(self, replica: RayReplica) -> None:
        """``ReplicaPool`` probe: raises when the replica cannot answer within the timeout."""
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            info = await asyncio.wait_for(_awaited(replica.client.health.remote()), self.config.health_check_timeout)
        except ActorDiedError:
            replica.state = "dead"
            raise
        except (TimeoutError, RayActorError):
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
        return {
            "backend": "ray",
            "target": f"{len(self.replicas)} replicas on {where}",
            "model": self.model_name,
            **self.description,
        }

    async def models(self) -> list[str]:
        return [self.model_name]

    # ---- calls --------------------------------------------------------------------------------

    def _pick(self, session_id: str | None, version: Any) -> RayReplica:
        """The session's replica among those on ``version`` (the call's start version)."""
        try:
            return self.pool.pick(session_id, accept=self.serves(version))
        except LookupError:
            raise self.no_replica_error(version) from None

    def _failed(self, replica: RayReplica, exc: BaseException, session_id: str | None, version: Any) -> RayReplica:
        """Mark ``replica`` down after ``exc`` and return where the session goes next: a replica on
        ``version``, the version the call started on (``control``), else ``version_unavailable``."""
        from ray.exceptions import ActorDiedError

        replica.state = "dead" if isinstance(exc, ActorDiedError) else "restarting"
        self.pool.mark_down(replica, failure_reason(exc))
        try:
            nxt = self.pool.pick(session_id, accept=self.serves(version))
        except LookupError:
            raise self.no_replica_error(
                version, failed=f"replica {replica.name} failed ({type(exc).__name__})"
            ) from None
        log.warning(
            "replica %s failed (%s); session %s retried on %s", replica.name, type(exc).__name__, session_id, nxt.name
        )
        return nxt

    async def _call(self, method: str, request: ChatRequest, ctx: RequestContext) -> Any:
        """``method`` (``chat`` or ``chat_chunks``) on the session's replica; on replica failure,
        once more on its new replica. Returns its result, raising the error a replica returned."""
        from ray.exceptions import RayActorError, RayTaskError

        if request.get("stream"):
            request = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        async with self.gate.call(), self.limiter.slot():
            version = self.fleet_version  # the version this call starts on (control module docstring)
            replica = self._pick(ctx.session_id, version)
            for attempt in range(2):
                replica.in_flight += 1
                ref = getattr(replica.client, method).remote(request, ctx.session_id, ctx.request_id)
                try:
                    result = await ref
                except asyncio.CancelledError:  # the client went away: stop generating on the replica
                    with contextlib.suppress(Exception):
                        import_ray().cancel(ref)
                    raise
                except RayActorError as exc:  # the replica's process or node died (or is restarting)
                    error = exc
                except RayTaskError as exc:  # a gymserve bug or engine crash inside the replica
                    raise EngineError(f"replica {replica.name} failed: {failure_reason(exc)}") from None
                else:
                    replica.served += 1
                    return raise_remote_error(result)
                finally:
                    replica.in_flight -= 1
                if attempt:
                    raise UpstreamConnectionError(
                        f"the call failed on two replicas (last: {replica.name}, {failure_reason(error)}); "
                        "the cluster may be losing nodes",
                        code="replica_failed",
                    )
                replica = self._failed(replica, error, ctx.session_id, version)
        raise AssertionError("unreachable")  # pragma: no cover

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """The replica's local backend's completion."""
        return await self._call("chat", request, ctx)

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The replica's chunks of the whole generation (``LocalBackend.answer``), for the Responses path."""
        chunks = await self._call("chat_chunks", request, ctx)
        return ChatAnswer.of_chunks(chunks, reasoning_field=self.config.local.reasoning_field)

    def fill_responses_defaults(self, request: ResponsesRequest) -> ResponsesRequest:
        """Echo the replicas' pinned sampling params, as the local backend does."""
        return echo_pinned_sampling(request, self.config.local.sampling)

    async def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Chat chunks from the session's replica (Ray streaming generator); see module docstring."""
        from ray.exceptions import RayActorError, RayTaskError

        ray = import_ray()
        async with self.gate.call(), self.limiter.slot():
            version = self.fleet_version
            replica = self._pick(ctx.session_id, version)
            for attempt in range(2):
                gen = replica.client.chat_stream.options(num_returns="streaming").remote(
                    request, ctx.session_id, ctx.request_id
                )
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
                            f"replica {replica.name} failed during the stream ({failure_reason(exc)}); retry the call",
                            code="replica_failed",
                        ) from None
                    error = exc
                except RayTaskError as exc:
                    done = True
                    raise EngineError(f"replica {replica.name} failed: {failure_reason(exc)}") from None
                finally:
                    replica.in_flight -= 1
                    if not done:  # client went away or a request error: stop the replica's generator
                        with contextlib.suppress(Exception):
                            ray.cancel(gen)
                replica = self._failed(replica, error, ctx.session_id, version)

    async def served_sessions(self) -> dict[str, dict[str, int]]:
        """``{replica name: {session_id: calls}}`` as each live replica process reports it (tests,
        debugging); replicas that do not answer within the probe timeout are left out."""
        out: dict[str, dict[str, int]] = {}
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                out[replica.name] = await asyncio.wait_for(
                    _awaited(replica.client.served_sessions.remote()), self.config.health_check_timeout
                )
        return out


async def _awaited(ref):
    # asyncio.wait_for needs an awaitable it can wrap in a task; a Ray ObjectRef is awaitable only.
    return await ref
