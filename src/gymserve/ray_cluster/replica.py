"""One policy replica: a Ray actor that owns a token-exact ``LocalBackend``.

The actor is an *async actor* (its methods are coroutines), so Ray runs them all on one event loop
inside the actor process; that is the loop the engine's per-request queues belong to, and many
requests are in flight at once and batched by the engine (Ray: "AsyncIO for Actors",
https://docs.ray.io/en/latest/ray-core/actors/async_api.html).

Wire shapes (plain dicts, the same as the HTTP API's, so nothing Ray-specific leaks into them):

- ``chat(request, session_id, request_id) -> ChatCompletion dict`` with the training fields;
- ``chat_chunks(...) -> [ChatCompletionChunk dict]``: the same generation's chunks, which keep the
  order the model wrote things in (the Responses path builds from them, as on one local backend);
- ``chat_stream(...)``: an async generator of ``ChatCompletionChunk`` dicts, called with
  ``num_returns="streaming"`` (Ray streaming generators,
  https://docs.ray.io/en/latest/ray-core/ray-generator.html);
- ``completions(...)`` / ``completions_stream(...)`` (``/v1/completions``), ``tokenize(...)`` and
  ``detokenize(...)``: the local backend's answers, with the same arguments and error payloads;
- ``info()`` / ``health()``: ``{"name", "incarnation", "pid", "node_id", "node_ip", "in_flight",
  "served", "model", ...LocalBackend.describe(), "control": the engine's control_status()}``
  (``incarnation`` is new in every process, so a restart shows as a changed value under the same
  name; ``control`` carries the weight version the replica serves);
- the control plane (``pause_generation``, ``apply`` / ``commit`` / ``rollback`` of a weight
  change, ``export_weights`` / ``import_weights``): ``replica_control.ReplicaControl``;
- ``served_sessions() -> {session_id: calls}``: which sessions this process served (bounded LRU).

Errors: a ``GymserveError`` raised by the local backend (bad request, context length, ...) is
*returned* as ``{ERROR_KEY: exc}`` rather than raised, because Ray re-raises task exceptions
wrapped in ``RayTaskError`` (a 500 to the server). Returned, the error travels as a value, pickled
with every field (``GymserveError.__reduce__``), and ``raise_remote_error`` raises it on the front
end, so clients get exactly the error a single-process server would give.
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from gymserve.ray_cluster.replica_control import ReplicaControl

ERROR_KEY = "__gymserve_error__"
_MAX_TRACKED_SESSIONS = 10_000


def error_payload(exc: BaseException) -> dict[str, Any]:
    """``{ERROR_KEY: exc}`` for a ``GymserveError``: Ray pickles it with every field
    (``GymserveError.__reduce__``), so the front end gets the same class and values."""
    return {ERROR_KEY: exc}


def raise_remote_error(result: Any) -> Any:
    """Return ``result`` unchanged unless it is an ``error_payload``; then raise the error it holds."""
    if isinstance(result, dict) and ERROR_KEY in result:
        raise result[ERROR_KEY]
    return result


class EngineReplica(ReplicaControl):
    """The actor body (wrapped with ``ray.remote`` by ``RayBackend``; usable without Ray in tests).

    ``name``: the replica's stable name (``replica-0``...), kept across restarts.
    ``local_config``: a ``LocalBackendConfig`` as a dict (model, engine, sampling, ...).
    ``num_cpus``: the CPUs Ray reserved for it; used as torch's thread count when the config does
    not set ``num_threads``, so replicas sharing a node do not oversubscribe its cores.

    The constructor loads the model; when Ray restarts the actor after a crash it runs again in a
    fresh process (a new ``incarnation``), which is how the front end counts restarts.
    """

    def __init__(self, name: str, local_config: dict[str, Any], num_cpus: float = 1.0):
        from gymserve.backends.local import LocalBackend
        from gymserve.config import LocalBackendConfig

        config = LocalBackendConfig.model_validate(local_config)
        if config.num_threads is None:
            config = config.model_copy(update={"num_threads": max(1, int(num_cpus))})
        self._serve(name, LocalBackend.from_config(config))

    @classmethod
    def serving(cls, name: str, backend: Any) -> EngineReplica:
        """A replica around an already built ``LocalBackend`` (in one process, without Ray)."""
        replica = cls.__new__(cls)
        replica._serve(name, backend)
        return replica

    def _serve(self, name: str, backend: Any) -> None:
        self.name = name
        self.incarnation = uuid.uuid4().hex
        self.backend = backend
        self.in_flight = 0
        self.served = 0
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._where = _where_am_i()

    # ---- introspection ------------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """Who and where this replica is, its load and its control status (see module docstring)."""
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            **self._where,
            "in_flight": self.in_flight,
            "served": self.served,
            **self.backend.describe(),
            # An engine a trainer supplies may implement generation only: then no control status.
            "control": getattr(self.backend.engine, "control_status", dict)(),
        }

    async def health(self) -> dict[str, Any]:
        """Same as ``info``; answering at all is the health signal (the event loop is alive)."""
        return await self.info()

    async def served_sessions(self) -> dict[str, int]:
        """``{session_id: calls served by this process}`` (the most recent 10,000 sessions)."""
        return dict(self._sessions)

    def _count(self, session_id: str | None) -> None:
        self.served += 1
        if session_id is None:
            return
        self._sessions[session_id] = self._sessions.pop(session_id, 0) + 1
        if len(self._sessions) > _MAX_TRACKED_SESSIONS:
            self._sessions.popitem(last=False)

    # ---- model calls --------------------------------------------------------------------------

    async def chat(
        self, request: dict[str, Any], session_id: str | None = None, request_id: str | None = None
    ) -> dict[str, Any]:
        """One Chat Completions call on the local backend; a GymserveError comes back as a payload."""
        return await self._answer(request, session_id, request_id, whole=False)

    async def chat_chunks(
        self, request: dict[str, Any], session_id: str | None = None, request_id: str | None = None
    ) -> list[dict[str, Any]] | dict[str, Any]:
        """The chunks of one whole generation (``LocalBackend.answer``), for the Responses path; a
        GymserveError comes back as a payload."""
        return await self._answer(request, session_id, request_id, whole=True)

    async def completions(
        self, request: dict[str, Any], session_id: str | None = None, request_id: str | None = None
    ) -> dict[str, Any]:
        """One ``/v1/completions`` call (``LocalBackend.completions``); errors come back as payloads."""
        return await self._served(self.backend.completions, request, session_id, request_id)

    async def tokenize(
        self, request: dict[str, Any], session_id: str | None = None, request_id: str | None = None
    ) -> dict[str, Any]:
        """vLLM's ``/tokenize`` answer (``LocalBackend.tokenize``); errors come back as payloads."""
        return await self._served(self.backend.tokenize, request, session_id, request_id)

    async def detokenize(
        self, request: dict[str, Any], session_id: str | None = None, request_id: str | None = None
    ) -> dict[str, Any]:
        """vLLM's ``/detokenize`` answer (``LocalBackend.detokenize``); errors come back as payloads."""
        return await self._served(self.backend.detokenize, request, session_id, request_id)

    async def _answer(
        self, request: dict[str, Any], session_id: str | None, request_id: str | None, *, whole: bool
    ) -> Any:
        answer = await self._served(self.backend.answer, request, session_id, request_id)
        if isinstance(answer, dict):  # an error payload
            return answer
        return answer.chunks if whole else answer.as_completion()

    async def _served(self, method: Any, request: dict[str, Any], session_id: str | None, request_id: str | None):
        """``await method(request, ctx)`` counted as one call of the session; a ``GymserveError``
        comes back as an ``error_payload``."""
        from gymserve.backends.base import RequestContext
        from gymserve.errors import GymserveError

        self.in_flight += 1
        try:
            answer = await method(request, RequestContext(session_id=session_id, request_id=request_id))
        except GymserveError as exc:
            return error_payload(exc)
        finally:
            self.in_flight -= 1
        self._count(session_id)
        return answer

    # Ray runs a streaming actor method as a generator only when the method itself is one.

    async def chat_stream(
        self, request: dict[str, Any], session_id: str | None = None, request_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Chat chunks of one streamed call; an error becomes a final payload item."""
        async for chunk in self._streamed(self.backend.chat_stream, request, session_id, request_id):
            yield chunk

    async def completions_stream(
        self, request: dict[str, Any], session_id: str | None = None, request_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """``/v1/completions`` chunks of one streamed call; an error becomes a final payload item."""
        async for chunk in self._streamed(self.backend.completions_stream, request, session_id, request_id):
            yield chunk

    async def _streamed(
        self, method: Any, request: dict[str, Any], session_id: str | None, request_id: str | None
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of ``method(request, ctx)``; an error becomes a final payload item.

        Ray cancels this generator (``CancelledError`` at an ``await``) when the caller cancels the
        stream, which closes the engine stream and stops generation.
        """
        from gymserve.backends.base import RequestContext
        from gymserve.errors import GymserveError

        self.in_flight += 1
        try:
            stream = method(request, RequestContext(session_id=session_id, request_id=request_id))
            async for chunk in stream:
                yield chunk
            self._count(session_id)
        except GymserveError as exc:
            yield error_payload(exc)
        finally:
            self.in_flight -= 1

    async def shutdown(self) -> None:
        """Stop the engine's worker thread (the front end then kills the actor)."""
        await self.backend.close()


def _where_am_i() -> dict[str, Any]:
    """Node and restart facts from Ray's runtime context (empty outside a Ray worker)."""
    try:
        import ray

        if not ray.is_initialized():
            return {"node_id": None, "node_ip": None}
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
    except Exception:  # noqa: BLE001 - introspection only; never fail a replica over it
        return {"node_id": None, "node_ip": None}
