"""The control state of an engine whose worker thread owns the model: pause modes, the pause
deadline, weight versions.

The async side sends a ``Command`` through the worker's inbox and awaits its future; the worker
runs it between two decode steps, so no forward pass ever sees a half-applied change. What each
pause mode (vLLM's names) means for the worker:

========  =======================  ==========================  ===============================
mode      calls in the batch       calls not yet admitted      the pause call returns
========  =======================  ==========================  ===============================
abort     end now, ``abort``       wait for resume             at once
wait      run to their end         wait for resume             when the batch is empty
keep      frozen; resume later     wait for resume             at once
========  =======================  ==========================  ===============================

A pause lasts until ``resume`` or its deadline, after which the worker resumes by itself and logs a
warning. A weight change (new tensors, or only a new version name after the caller changed the
weights itself) marks the KV cache of calls still in the batch stale: the engine recomputes it on
the new weights before their next step, so every token's log-prob is the policy's of the version
that sampled it, given the whole context (what teacher forcing on that version computes).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

# The argument checks every control shares are declared with the verbs (``gymserve.control``).
from gymserve.control import check_mode, check_timeout, check_version
from gymserve.engine.base import PauseMode, WeightVersion
from gymserve.errors import ConflictError, EngineDownError, EngineError

log = logging.getLogger("gymserve.engine")


class UndoLog:
    """The values weight updates overwrote, kept so that they can be put back: how a fleet of
    replicas updates all or none (``ray_cluster.control``: an update that fails on one replica is
    undone on the others). ``restore()`` copies every kept value back into the served tensor it
    came from; a tensor overwritten twice keeps its first (oldest) value. Costs a copy of every
    tensor updated (the whole model for a full update) while the log lives."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []
        self._seen: set[tuple] = set()

    def keep(self, plan: list[tuple[Any, Any]]) -> None:
        """Copy the served tensors of ``plan`` (``engine.weights.load_update``'s) before they change."""
        for served, _new in plan:
            key = (served.data_ptr(), tuple(served.shape), served.stride())  # tied tensors share one entry
            if key not in self._seen:
                self._seen.add(key)
                self.pairs.append((served, served.detach().clone()))

    def restore(self) -> None:
        """Copy the kept values back (on the worker thread, between two decode steps)."""
        from gymserve.engine.weights import apply_plan

        apply_plan(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


_UNDO: contextvars.ContextVar[UndoLog | None] = contextvars.ContextVar("gymserve_weight_undo", default=None)


@contextlib.contextmanager
def recording_undo() -> Iterator[UndoLog]:
    """Within the block, every weight update of an engine awaited from this task (``update_weights``,
    LoRA loads and unloads, which update weights) keeps the values it overwrites in the yielded
    ``UndoLog``. A context variable rather than an argument, so the LoRA operations, which call
    ``update_weights`` themselves, keep theirs too without a parameter on every method."""
    log_ = UndoLog()
    token = _UNDO.set(log_)
    try:
        yield log_
    finally:
        _UNDO.reset(token)


@dataclass
class Command:
    """One request to the worker. ``kind``: ``pause`` (``mode``, ``timeout``), ``resume``,
    ``weights`` (``apply`` copies validated tensors, or is None when only the version changes;
    ``version``: the caller's name for the new weights, None to count), or ``run`` (``apply`` runs
    on the worker between two steps; its result answers the future: ``engine.sleep``)."""

    kind: str
    future: Future = field(default_factory=Future)
    mode: PauseMode | None = None
    timeout: float | None = None
    apply: Callable[[], Any] | None = None
    version: WeightVersion | None = None


class ControlState:
    """Worker-side state; other threads read it only through ``status()`` and ``paused``."""

    def __init__(self, weight_version: WeightVersion = 0):
        self.weight_version: WeightVersion = weight_version
        self.updates = 0
        self.mode: PauseMode | None = None
        self.deadline: float | None = None
        self.timeout: float | None = None
        self.stale = False  # the KV cache of calls in the batch predates the current weights
        self.last_update_seconds: float | None = None
        self.sleep_level = 0  # vLLM's sleep level (engine.sleep): 0 awake, 1 caches dropped, 2 weights released too
        self.weights_released = False  # woken from level 2: the weights are placeholders until an update
        self._waiters: list[Future] = []  # pause calls not answered yet (wait mode, batch not empty)

    @property
    def paused(self) -> PauseMode | None:
        return self.mode

    @property
    def admitting(self) -> bool:
        """Whether calls waiting for the batch may be admitted (not while asleep, nor on released weights)."""
        return self.mode is None and self.sleep_level == 0 and not self.weights_released

    @property
    def decoding(self) -> bool:
        """Whether calls in the batch take steps."""
        return self.mode in (None, "wait")

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the pause deadline (None when not paused)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - (time.monotonic() if now is None else now))

    def pause(self, cmd: Command) -> None:
        """Enter (or change to) ``cmd.mode``; the future is answered by ``settle``."""
        self.mode, self.timeout = cmd.mode, cmd.timeout
        self.deadline = time.monotonic() + float(cmd.timeout or 0)
        self._waiters.append(cmd.future)
        log.info("generation paused (mode %s, resumes by itself in %g s unless resumed)", cmd.mode, cmd.timeout)

    def settle(self, in_batch: int) -> None:
        """Answer the pause calls once the pause has taken effect (for ``wait``: the batch is empty)."""
        if self.mode is not None and self._waiters and (self.mode != "wait" or in_batch == 0):
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(None)
            self._waiters.clear()

    def resume(self, reason: str = "resume_generation") -> None:
        """Leave the pause; pause calls still waiting get a ``ConflictError`` (409) saying why."""
        if self.mode is None:
            return
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(
                    ConflictError(
                        f"the {self.mode} pause ended ({reason}) before the calls in flight finished; generation "
                        "continues. Pause with a longer timeout, or with mode=abort or mode=keep, which take effect at once",
                        code="pause_ended",
                    )
                )
        self._waiters.clear()
        self.mode = self.deadline = self.timeout = None

    def expire(self) -> None:
        """Resume when the deadline has passed, and say so in the log."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            log.warning(
                "generation pause (mode %s) reached its deadline of %g s without resume_generation; resuming by itself",
                self.mode,
                self.timeout,
            )
            self.resume(reason=f"its deadline of {self.timeout:g} s passed")

    def new_weights(self, cmd: Command, in_batch: int) -> WeightVersion:
        """Apply ``cmd`` (the caller measures and validated it) and move to the next version."""
        if cmd.apply is not None:
            cmd.apply()
            self.weights_released = False  # new values over the placeholders of a level-2 wake-up
        self.updates += 1
        self.weight_version = self.updates if cmd.version is None else cmd.version
        self.stale = self.stale or in_batch > 0
        log.info(
            "weights updated to version %r (%d calls in the batch continue on them)", self.weight_version, in_batch
        )
        return self.weight_version

    def status(self) -> dict[str, Any]:
        """``{"weight_version", "weight_updates", "paused": mode | None, "pause_seconds_left",
        "last_update_seconds", "sleep_level", "weights_released"}`` for ``/health``, ``/is_paused`` and ``/metrics``."""
        return {
            "weight_version": self.weight_version,
            "weight_updates": self.updates,
            "paused": self.mode,
            "pause_seconds_left": self.seconds_left(),
            "last_update_seconds": self.last_update_seconds,
            "sleep_level": self.sleep_level,
            "weights_released": self.weights_released,
        }

    def fail_all(self, exc: BaseException) -> None:
        """At shutdown: answer every waiting pause call with ``exc``."""
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(exc)
        self._waiters.clear()


class WorkerControl:
    """The async control API of an engine whose worker thread owns ``self.model`` and reads
    ``self._inbox`` (names as vLLM's ``AsyncLLM`` has them). The engine sets ``self._control`` (a
    ``ControlState``), ``self._inbox``, ``self._closed``, ``self.pause_timeout`` and
    ``self._update_lock = None``, and runs each ``Command`` it pulls from the inbox between steps."""

    model: Any
    pause_timeout: float
    _control: ControlState
    _inbox: Any
    _closed: bool
    _update_lock: asyncio.Lock | None
    _fault: str | None = None  # why the worker died ("OverflowError: ..."), None while it runs

    @property
    def weight_version(self) -> WeightVersion:
        """The version of the weights now serving (0 for the loaded ones; see ``update_weights``)."""
        return self._control.weight_version

    def control_status(self) -> dict[str, Any]:
        """See ``ControlState.status``."""
        return self._control.status()

    async def _send(self, cmd: Command) -> Any:
        if self._fault is not None:
            raise EngineDownError(getattr(self, "engine_name", type(self).__name__), self._fault)
        if self._closed:
            raise EngineError("the engine is shut down")
        self._inbox.put(cmd)
        return await asyncio.wrap_future(cmd.future)

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """Stop sampling in ``mode`` (see ``engine.control``) for at most ``timeout`` seconds
        (default ``pause_timeout``); returns once the pause has taken effect. Calling it while
        paused changes the mode and restarts the deadline. Raises ``InvalidRequestError`` for a bad
        mode or timeout, ``ConflictError`` (409) when a ``wait`` pause ends before the batch drained."""
        timeout = self.pause_timeout if timeout is None else check_timeout(timeout)
        await self._send(Command("pause", mode=check_mode(mode), timeout=timeout))

    async def resume_generation(self) -> None:
        """End the pause (a no-op when not paused): frozen calls continue, waiting ones are admitted."""
        await self._send(Command("resume"))

    async def is_paused(self) -> bool:
        """Whether generation is paused now."""
        return self._control.paused is not None

    async def update_weights(
        self,
        tensors: Mapping[str, Any] | None = None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: WeightVersion | None = None,
    ) -> WeightVersion:
        """Swap in new weights, all or nothing, and return the new version.

        ``tensors``: name → tensor (any subset of ``model.state_dict()``), or ``path``: safetensors
        in Hugging Face layout (see ``engine.weights``). ``weight_version``: the name of the new
        weights (default: the count of updates so far, an int). Reading and validation run off the
        worker; the copy runs on it between two decode steps. Raises ``WeightUpdateError`` (400)
        naming the tensor or file when anything is wrong; then nothing changed.
        """
        from gymserve.engine.weights import apply_plan, load_update

        version = None if weight_version is None else check_version(weight_version)
        undo = _UNDO.get()
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:  # one update at a time: each validates against the weights it replaces
            t0 = time.perf_counter()
            plan = await asyncio.to_thread(load_update, self.model, tensors, path=path)

            def apply() -> None:
                if undo is not None:
                    undo.keep(plan)
                apply_plan(plan)

            new = await self._send(Command("weights", apply=apply, version=version))
            self._control.last_update_seconds = time.perf_counter() - t0
        return new

    async def restore_weights(self, undo: UndoLog, weight_version: WeightVersion) -> WeightVersion:
        """Put back the values ``undo`` kept (``recording_undo``) and name them ``weight_version``
        (the version they had), atomically between two decode steps; returns that version."""
        version = check_version(weight_version)
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            return await self._send(Command("weights", apply=undo.restore, version=version))

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        """Name the weights ``new_version`` after the caller changed ``self.model`` itself (paused,
        so no step saw a half-changed model); calls in the batch get their KV cache recomputed."""
        await self._send(Command("weights", version=check_version(new_version, "new_version")))
