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
- gymserve: the chat backend's ``ReplicaPool`` routes the calls, with the same policy
  (``routing.policy``: sticky-least-loaded by default — a new session goes to the replica with the
  fewest calls in flight and stays there), circuit breakers and retry budget; a failed call opens
  the replica's breaker, re-assigns the session, and is retried ONCE on the session's new replica
  (if the retry budget allows) — on a replica on the weight version the call started on
  (``control``: a call is never answered by other weights than the ones it started on). The request carries the whole conversation with its token
  fields, so the new replica re-prefills the exact same prompt token IDs (the prefix splice) —
  the retried call's training fields are as correct as the first try's would have been; only the
  KV cache is rebuilt. A background probe (``health()`` with a timeout) marks replicas up again
  and counts restarts (a new ``incarnation`` answering under the same name).
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
from gymserve.backends.local.request import echo_sampling
from gymserve.backends.pool import Limiter, Outcome, ReplicaPool, usage_of
from gymserve.backends.responses_over_chat import ChatAnswer
from gymserve.backends.stream_end import StreamEnd
from gymserve.errors import EngineError, NoReplicaError, UpstreamConnectionError, UpstreamStreamIncompleteError
from gymserve.protocol import ChatCompletionDict, ChatRequest, ResponsesRequest
from gymserve.ray_cluster.control import FleetControl
from gymserve.ray_cluster.fleet import RayReplica, ReplicaFleet, failure_reason, import_ray
from gymserve.ray_cluster.replica import raise_remote_error

log = logging.getLogger("gymserve.ray")


class RayBackend(Backend):
    """N replicas of one model on a Ray cluster; see the module docstring.

    ``config``: a ``gymserve.config.RayBackendConfig``. ``max_queue``: requests allowed to wait
    beyond ``replicas * max_concurrent_requests`` in flight (429 beyond that). The Responses API
    runs through ``responses_over_chat`` on the replicas' chunks (``answer``), with the pinned
    sampling params echoed, so a Response is the one a single local backend gives for the same tokens.
    The control plane (pause, all-or-none weight changes, one version per call) is
    ``control.FleetControl``, held as ``control``: calls are admitted through its gate and routed
    to the replicas on its version.
    """

    name = "ray"
    limiter: Limiter
    pool: ReplicaPool
    control: FleetControl

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
        self.pool = ReplicaPool(
            replicas, probe=self._probe, interval=config.health_check_interval, routing=config.routing
        )
        self.limiter = Limiter(config.replicas * config.max_concurrent_requests, max_queue, name="ray backend")
        self.control = FleetControl(replicas, config, infos, max_queue)
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
        await self.control.close()
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
        if isinstance(self.control, FleetControl):  # after start-up: it tracks versions once the fleet's is known
            self.control.track(replica, info)

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
        status = self.pool.status()
        return {
            "status": status["status"],
            **self.describe(),
            "routing": status["routing"],
            "retry_budget": status["retry_budget"],
            "replicas": [{**r.row(), **self.pool.replica_row(r)} for r in self.replicas],
        }

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

    def _pick(
        self, session_id: str | None, version: Any, *, exclude: tuple[RayReplica, ...] = (), failed: str | None = None
    ) -> RayReplica:
        """The session's replica among those on ``version``, the weight version the call started on
        (``control``: a call is never answered by other weights); ``exclude``: replicas that already
        failed it. Raises ``no_replica_error`` (502 ``version_unavailable``) when none serves it."""
        try:
            return self.pool.pick(session_id, exclude=exclude, where=self.control.serves(version))
        except NoReplicaError:
            raise self.control.no_replica_error(version, failed=failed) from None

    def _failed(
        self, replica: RayReplica, exc: BaseException, session_id: str | None, version: Any, *, retry: bool
    ) -> RayReplica:
        """Release ``replica`` after ``exc`` (its process or node died or is restarting: its breaker
        opens) and, when ``retry`` and the retry budget allow, return where the call goes next: a
        replica on ``version``, the version the call started on; otherwise raise
        ``UpstreamConnectionError`` (502, ``replica_failed``, or ``version_unavailable``)."""
        from ray.exceptions import ActorDiedError

        reason = failure_reason(exc)
        replica.state = "dead" if isinstance(exc, ActorDiedError) else "restarting"
        self.pool.release(replica, Outcome.DOWN, reason=reason)
        if not retry:
            raise UpstreamConnectionError(
                f"the call failed on two replicas (last: {replica.name}, {reason}); the cluster may be losing nodes",
                code="replica_failed",
            )
        if not self.pool.retry_budget.try_withdraw():
            raise UpstreamConnectionError(
                f"replica {replica.name} failed ({reason}) and the retry budget allows no retry now (too many "
                "calls are failing); retry the call later",
                code="replica_failed",
            )
        nxt = self._pick(
            session_id, version, exclude=(replica,), failed=f"replica {replica.name} failed ({type(exc).__name__})"
        )
        log.warning(
            "replica %s failed (%s); session %s retried on %s", replica.name, type(exc).__name__, session_id, nxt.name
        )
        return nxt

    def _answered(self, replica: RayReplica, ctx: RequestContext, result: Any) -> Any:
        """Release ``replica`` after it answered; returns the answer, raising the request error it holds."""
        replica.served += 1
        try:
            answer = raise_remote_error(result)
        except BaseException:
            self.pool.release(replica, Outcome.REJECTED)
            raise
        usage = usage_of(answer if isinstance(answer, dict) else _last_usage(answer))
        self.pool.release(replica, Outcome.OK, session_id=ctx.session_id, usage=usage)
        return answer

    async def _call(self, method: str, request: dict[str, Any], ctx: RequestContext) -> Any:
        """``method`` (an ``EngineReplica`` call: ``chat``, ``chat_chunks``, ``completions``,
        ``tokenize``, ``detokenize``) on the replica the pool picks for the session; on
        replica failure, once more on another one (within the retry budget). Returns its result,
        raising the error a replica returned."""
        from ray.exceptions import RayActorError, RayTaskError

        if request.get("stream"):
            request = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        async with self.control.gate.call(), self.limiter.slot():
            version = self.control.fleet_version  # the version this call starts on (control module docstring)
            replica = self._pick(ctx.session_id, version)
            for attempt in range(2):
                ctx.extra["replica"] = replica.name
                ref = getattr(replica.client, method).remote(request, ctx.session_id, ctx.request_id)
                try:
                    result = await ref
                except asyncio.CancelledError:  # the client went away: stop generating on the replica
                    self.pool.release(replica, Outcome.CANCELLED)
                    with contextlib.suppress(Exception):
                        import_ray().cancel(ref)
                    raise
                except RayActorError as exc:  # the replica's process or node died (or is restarting)
                    error = exc
                except RayTaskError as exc:  # a gymserve bug or engine crash inside the replica
                    self.pool.release(replica, Outcome.FAILED, reason=failure_reason(exc))
                    raise EngineError(f"replica {replica.name} failed: {failure_reason(exc)}") from None
                else:
                    return self._answered(replica, ctx, result)
                replica = self._failed(replica, error, ctx.session_id, version, retry=not attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    async def chat(self, request: ChatRequest, ctx: RequestContext) -> ChatCompletionDict:
        """The replica's local backend's completion."""
        return await self._call("chat", request, ctx)

    async def answer(self, request: ChatRequest, ctx: RequestContext) -> ChatAnswer:
        """The replica's chunks of the whole generation (``LocalBackend.answer``), for the Responses path."""
        chunks = await self._call("chat_chunks", request, ctx)
        return ChatAnswer.of_chunks(chunks, reasoning_field=self.config.local.reasoning_field)

    def fill_responses_defaults(self, request: ResponsesRequest) -> ResponsesRequest:
        """Echo the sampling params the replicas run with, as the local backend does."""
        return echo_sampling(request, self.config.local.sampling)

    def chat_stream(self, request: ChatRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Chat chunks from the session's replica (Ray streaming generator); see module docstring."""
        return self._stream("chat_stream", request, ctx)

    async def completions(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """The replica's local backend's ``/v1/completions`` answer (routed, pinned and failed over
        as chat is)."""
        return await self._call("completions", request, ctx)

    def completions_stream(self, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """``/v1/completions`` chunks from the session's replica, streamed as ``chat_stream``'s."""
        return self._stream("completions_stream", request, ctx)

    async def tokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``/tokenize`` from the session's replica: the IDs its generation would see."""
        return await self._call("tokenize", request, ctx)

    async def detokenize(self, request: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        """vLLM's ``/detokenize`` from the session's replica."""
        return await self._call("detokenize", request, ctx)

    async def _stream(self, method: str, request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """The chunks of ``method`` (``chat_stream`` or ``completions_stream``, a replica's streaming
        generator) from the session's replica; see the module docstring for failover."""
        from ray.exceptions import RayActorError, RayTaskError

        ray = import_ray()
        async with self.control.gate.call(), self.limiter.slot():
            version = self.control.fleet_version  # the version this call starts on (control module docstring)
            replica = self._pick(ctx.session_id, version)
            for attempt in range(2):
                ctx.extra["replica"] = replica.name
                gen = (
                    getattr(replica.client, method)
                    .options(num_returns="streaming")
                    .remote(request, ctx.session_id, ctx.request_id)
                )
                started = done = False
                outcome: Outcome | None = Outcome.CANCELLED  # unless the stream ends otherwise
                usage = None
                end = StreamEnd("chat")  # chat and completions chunks end alike: a finish_reason per choice
                try:
                    async for ref in gen:
                        raw = await ref
                        outcome = Outcome.REJECTED  # a request error the replica returned is raised here
                        chunk = raise_remote_error(raw)
                        outcome = Outcome.CANCELLED
                        started = True
                        usage = usage_of(chunk) or usage
                        if isinstance(chunk, dict):
                            end.see(chunk)
                        yield chunk
                    done = True
                    if not end.complete:
                        # The replica's generator stopped without finishing its answer (an engine
                        # that stopped producing): never let the cut-off answer look finished.
                        outcome = Outcome.FAILED
                        replica.stats.streams_incomplete += 1
                        raise UpstreamStreamIncompleteError(
                            f"replica {replica.name} ended the stream without {end.expected}: the answer was cut "
                            "short and is not complete; send the call again"
                        )
                    replica.served += 1
                    outcome = Outcome.OK
                    return
                except RayActorError as exc:
                    done = True  # the generator died with its replica
                    outcome = None  # released below, with the failover decision
                    error = exc
                except RayTaskError as exc:
                    done = True
                    outcome = Outcome.FAILED
                    raise EngineError(f"replica {replica.name} failed: {failure_reason(exc)}") from None
                finally:
                    if not done:  # client went away or a request error: stop the replica's generator
                        with contextlib.suppress(Exception):
                            ray.cancel(gen)
                    if outcome is not None:
                        self.pool.release(replica, outcome, session_id=ctx.session_id, usage=usage)
                if started:  # chunks already sent cannot be taken back
                    with contextlib.suppress(UpstreamConnectionError):
                        self._failed(replica, error, ctx.session_id, version, retry=False)
                    raise UpstreamConnectionError(
                        f"replica {replica.name} failed during the stream ({failure_reason(error)}); retry the call",
                        code="replica_failed",
                    )
                replica = self._failed(replica, error, ctx.session_id, version, retry=not attempt)

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


def _last_usage(chunks: Any) -> Any:
    """The last chunk carrying ``usage`` in a list of chat chunks (None when none does)."""
    if isinstance(chunks, list):
        for chunk in reversed(chunks):
            if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
                return chunk
    return None
