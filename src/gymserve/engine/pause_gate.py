"""Pause and resume applied at a door: to the calls passing through it, not inside a decode loop.

The transformers engine pauses inside its decode loop (``engine.control``). Whatever cannot — the
chat backend before a trainer's own vLLM/SGLang servers, the Ray backend before its replicas, the
TensorRT-LLM adapter before an ``LLM`` without a pause of its own — pauses at its door instead: a
``PauseGate`` holds new calls while paused and knows the calls in flight, so each pause mode
(vLLM's names) means what it can mean there:

========  ==========================================  ===============================================
mode      calls in flight                             new calls
========  ==========================================  ===============================================
abort     ended now (``Call.aborted`` is set; the     held until resume, never dropped
          caller ends its call with what it has, as
          an aborted answer), unless the upstream
          aborts them itself (``abort_in_flight``)
wait      run to their end; ``pause`` returns once    held until resume
          none is left (``drain``), or answers 409
          ``pause_ended`` at the deadline
keep      run on (a gateway cannot freeze another     held until resume
          server's batch; the upstream freezes them
          when it has a keep mode of its own)
========  ==========================================  ===============================================

Held calls are bounded: at most ``max_queue`` wait at the gate, beyond that ``OverloadedError``
(429 with ``Retry-After``), the answer a full queue gives everywhere in gymserve. A pause has a
deadline (``timeout`` seconds, default ``default_timeout``): when it passes without ``resume`` the
gate resumes by itself and logs a warning, so a trainer that crashed mid-update never leaves the
rollouts hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from gymserve.engine.base import PauseMode
from gymserve.errors import ConflictError, OverloadedError

log = logging.getLogger("gymserve.pause")

T = TypeVar("T")


class CallAborted(Exception):
    """Raised by ``Call.race`` when a pause with mode ``abort`` ended the call."""


class Call:
    """One call admitted through a ``PauseGate``; ``aborted`` is set by an ``abort`` pause
    (:meth:`abort`)."""

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self._racing: set[asyncio.Task[Any]] = set()

    def abort(self) -> None:
        """End the call: set ``aborted`` and cancel what :meth:`race` awaits now."""
        self.aborted.set()
        for task in self._racing:
            task.cancel()

    async def race(self, work: Awaitable[T]) -> T:
        """``work``'s result, or ``CallAborted`` once an abort pause ends the call first (``work``
        is then cancelled: an HTTP call to the upstream is closed, which makes vLLM and SGLang
        abort the request).

        ``work`` runs in the calling task, which :meth:`abort` cancels (``asyncio.timeout``'s
        technique: ``uncancel`` tells that cancellation from any other): a task for ``work`` and
        one for the abort event, with an ``asyncio.wait``, cost every gateway call (and every
        streamed chunk) a tenth of its latency (issue #30)."""
        if self.aborted.is_set():
            if inspect.iscoroutine(work):
                work.close()  # never started: nothing to clean up
            raise CallAborted()
        task = asyncio.current_task()
        assert task is not None, "Call.race runs inside a task"
        self._racing.add(task)
        try:
            return await work
        except asyncio.CancelledError:
            if self.aborted.is_set() and task.uncancel() == 0:  # only the abort cancelled it
                raise CallAborted() from None
            raise
        finally:
            self._racing.discard(task)

    async def until_aborted(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """``items`` until they end or an abort pause ends the call (then ``aborted`` is set and
        the iterator is closed, which closes the upstream stream)."""
        it = aiter(items)
        try:
            while True:
                try:
                    item = await self.race(anext(it))
                except StopAsyncIteration:
                    return
                except CallAborted:
                    return
                yield item
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


class PauseGate:
    """See the module docstring. ``name`` names the front end in messages; ``max_queue`` bounds
    the calls held while paused; ``default_timeout``: a pause's deadline when it names none."""

    def __init__(self, *, name: str, default_timeout: float = 300.0, max_queue: int = 1024):
        self.name = name
        self.default_timeout = default_timeout
        self.max_queue = max_queue
        self.mode: PauseMode | None = None
        self.timeout: float | None = None
        self.deadline: float | None = None
        self.waiting = 0
        self.in_flight: set[Call] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._timer: asyncio.Task | None = None
        self._changed = asyncio.Event()

    # ---- calls ---------------------------------------------------------------------------------

    def call(self) -> contextlib.AbstractAsyncContextManager[Call]:
        """Admit one call: wait while paused (``OverloadedError`` when ``max_queue`` calls already
        wait), then count it in flight until the block ends. (A plain class, not a generator-based
        context manager: it is entered by every call through the chat gateway — issue #30.)"""
        return _Admission(self)

    async def _admit(self) -> Call:
        if not self._open.is_set():
            if self.waiting >= self.max_queue:
                raise OverloadedError(
                    f"{self.name} is paused and {self.waiting} calls already wait for it to resume "
                    f"(max_queue={self.max_queue}); retry later",
                    retry_after=1.0,
                )
            self.waiting += 1
            try:
                while not self._open.is_set():  # a pause right after a resume closes the gate again
                    await self._open.wait()
            finally:
                self.waiting -= 1
        call = Call()
        self.in_flight.add(call)
        self._drained.clear()
        return call

    def _leave(self, call: Call) -> None:
        self.in_flight.discard(call)
        if not self.in_flight:
            self._drained.set()

    # ---- pause and resume ----------------------------------------------------------------------

    @property
    def paused(self) -> PauseMode | None:
        return self.mode

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def pause(
        self, mode: PauseMode, timeout: float | None = None, *, abort_in_flight: bool = True, drain: bool = True
    ) -> None:
        """Hold new calls in ``mode`` for at most ``timeout`` s; for ``abort`` end the calls in
        flight (unless ``abort_in_flight`` is False: the upstream aborts them itself); for ``wait``
        with ``drain`` return once none is left, raising ``ConflictError`` (409 ``pause_ended``)
        if the pause ends first. Pausing while paused changes the mode and restarts the deadline."""
        timeout = self.default_timeout if timeout is None else timeout
        self.mode, self.timeout = mode, timeout
        self.deadline = time.monotonic() + timeout
        self._open.clear()
        self._signal()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().create_task(self._expire(timeout), name="gymserve-pause-deadline")
        log.info("%s paused (mode %s, resumes by itself in %g s unless resumed)", self.name, mode, timeout)
        if mode == "abort" and abort_in_flight:
            for call in list(self.in_flight):
                call.abort()
        if mode == "wait" and drain:
            await self.drain()

    async def drain(self) -> None:
        """Wait until no call is in flight; ``ConflictError`` (409 ``pause_ended``) when the pause
        is resumed (by a call or its deadline) first. A change to ``abort`` or ``keep`` meanwhile
        ends the wait: that pause is in effect at once."""
        while self.in_flight and self.mode == "wait":
            changed = self._changed
            waits = {asyncio.ensure_future(self._drained.wait()), asyncio.ensure_future(changed.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        if self.in_flight and self.mode is None:
            raise ConflictError(
                f"the wait pause of {self.name} ended before the calls in flight finished "
                f"({len(self.in_flight)} left); generation continues. Pause with a longer timeout, or with "
                "mode=abort or mode=keep, which take effect at once",
                code="pause_ended",
            )

    def _signal(self) -> None:
        """Wake whoever waits on a change of the pause state."""
        self._changed.set()
        self._changed = asyncio.Event()

    def resume(self, reason: str = "resume_generation") -> None:
        """Let held calls go (a no-op when not paused)."""
        if self.mode is None:
            return
        log.info("%s resumed (%s)", self.name, reason)
        self.mode = self.timeout = self.deadline = None
        self._signal()
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer = None
        self._open.set()

    async def _expire(self, timeout: float) -> None:
        await asyncio.sleep(timeout)
        log.warning(
            "generation pause (mode %s) reached its deadline of %g s without resume_generation; resuming by itself",
            self.mode,
            timeout,
        )
        self.resume(reason=f"its deadline of {timeout:g} s passed")

    def status(self) -> dict[str, Any]:
        """``{"paused": mode | None, "pause_seconds_left", "calls_waiting", "calls_in_flight"}``."""
        return {
            "paused": self.mode,
            "pause_seconds_left": self.seconds_left(),
            "calls_waiting": self.waiting,
            "calls_in_flight": len(self.in_flight),
        }

    def close(self) -> None:
        """Stop the deadline timer and let held calls go (they then meet a closed backend)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.mode = self.deadline = self.timeout = None
        self._open.set()


class _Admission(contextlib.AbstractAsyncContextManager[Call]):
    """``PauseGate.call()``: the admitted ``Call`` while the block runs."""

    __slots__ = ("_gate", "_call")

    def __init__(self, gate: PauseGate) -> None:
        self._gate = gate
        self._call: Call | None = None

    async def __aenter__(self) -> Call:
        self._call = await self._gate._admit()
        return self._call

    async def __aexit__(self, *exc: object) -> None:
        if self._call is not None:
            self._gate._leave(self._call)
