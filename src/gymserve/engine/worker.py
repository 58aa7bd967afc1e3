"""The plumbing shared by engines whose worker thread owns the model (transformers, llamacpp).

The async side puts a request (or a control ``Command``) into the worker's inbox and reads the
request's own asyncio queue, which the worker fills from its thread with ``TokenDelta``s (or an
exception) through ``loop.call_soon_threadsafe``; leaving the stream early marks the request
cancelled, and the worker drops it at its next step. The worker pulls everything waiting in the
inbox between two steps, runs control commands there (``engine.control``), and at shutdown ends
every call still open with ``EngineError``. An engine subclasses ``WorkerEngine`` and supplies its
request type (``_new_request``), its batch (``_running``, ``_abort_running``) and the loop itself.

A worker that dies on an exception (a bug, an ``OverflowError`` from the OS, anything its loop does
not catch) leaves the engine **down**, never silently stuck: ``fault`` says why, every call in
flight and every control command gets ``EngineDownError`` (503, naming the engine and the cause),
and the thread stays on as an answering machine that fails whatever still reaches the inbox until
shutdown, so no caller waits forever and ``close`` (SIGTERM) still returns. The backend's
``/health`` reports ``down`` with ``fault``. A crash in native code (SIGSEGV in llama.cpp) kills the
process instead: see docs/concepts/engine-faults.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gymserve.engine.base import Generation, SamplingParams, TokenDelta, collect
from gymserve.engine.control import Command, ControlState, WorkerControl
from gymserve.engine.ending import Ending
from gymserve.errors import EngineDownError, EngineError

log = logging.getLogger("gymserve.engine")

#: The longest single wait of the worker for its inbox, in seconds. Any longer deadline (a pause's)
#: is waited for in steps of this: ``queue.get`` turns its timeout into an OS deadline, and one too
#: far away raises ``OverflowError`` (``timestamp out of range for platform time_t``).
MAX_WAIT_SECONDS = 3600.0


@dataclass
class WorkerRequest:
    """One generation as the worker sees it: the prompt, its sampling params, where its deltas go
    (``out`` on ``loop``), its ``engine.ending.Ending`` (what ends it), and whether its caller left
    (``cancelled``)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    ending: Ending
    cancelled: bool = False
    id: int = field(default_factory=itertools.count().__next__)

    def emit(self, item: TokenDelta | BaseException) -> None:
        """Hand ``item`` to the caller's event loop (thread-safe)."""
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class WorkerEngine(WorkerControl):
    """``generate``/``stream``/``close`` and the worker's inbox, commands and shutdown.

    The engine sets ``eos_token_ids``, ``_control`` (a ``ControlState``), ``pause_timeout`` and
    ``_update_lock = None``, then calls ``_start_worker(run)`` with its loop, which calls ``_pull``,
    ``_command`` and ``_drain``."""

    eos_token_ids: tuple[int, ...]
    _control: ControlState
    _waiting: deque
    _thread: threading.Thread

    @staticmethod
    def config_args(config: Any, resolved: Any) -> dict[str, Any]:
        """The constructor arguments every CPU engine takes from a ``LocalBackendConfig`` and a
        ``model_store.ResolvedModel`` (each engine's ``from_config`` adds its own)."""
        return {
            "model_name": resolved.name,
            "max_batch_size": config.max_num_seqs,
            "context_window": config.max_model_len,
            "num_threads": config.num_threads,
            "pause_timeout": config.pause_timeout,
        }

    def _start_worker(self, run: Callable[[], None], name: str) -> None:
        self._waiting = deque()  # worker-only: requests not admitted yet
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._fault = None
        self._thread = threading.Thread(target=self._worker_main, args=(run,), name=name, daemon=True)
        self._thread.start()

    @property
    def fault(self) -> str | None:
        """None while the worker runs; once it died, why (``"OverflowError: timestamp out of range..."``)."""
        return self._fault

    def _down_error(self) -> EngineDownError:
        return EngineDownError(getattr(self, "engine_name", type(self).__name__), self._fault or "an unknown error")

    def _worker_main(self, run: Callable[[], None]) -> None:
        """The worker thread: ``run``, and when it dies on an exception, the engine goes down (see
        the module docstring): every open call and command fails, and so does anything sent later."""
        try:
            run()
            return
        except BaseException as exc:  # noqa: BLE001 - the engine goes down; nothing may wait on it
            self._fault = f"{type(exc).__name__}: {exc}"
            log.critical(
                "the %s engine's worker thread died; the engine is down until gymserve restarts",
                getattr(self, "engine_name", type(self).__name__),
                exc_info=exc,
            )
        err = self._down_error()
        self._control.fail_all(err)
        try:
            open_calls = [*self._running(), *self._waiting]
        except Exception:  # noqa: BLE001 - the engine's state may be what broke
            open_calls = list(self._waiting)
        for r in open_calls:
            r.emit(err)
        self._waiting.clear()
        while True:  # the answering machine: nothing that reaches the inbox waits forever
            item = self._inbox.get()
            if item is None:
                return
            if isinstance(item, Command):
                if not item.future.done():
                    item.future.set_exception(err)
            else:
                item.emit(err)

    # ---- what the engine supplies ------------------------------------------------------------

    def _new_request(self, prompt_ids: list[int], sampling: SamplingParams, **common: Any) -> WorkerRequest:
        """The engine's request for ``prompt_ids`` (``common``: ``WorkerRequest``'s fields)."""
        raise NotImplementedError

    def _running(self) -> list:
        """The requests in the batch now (worker thread)."""
        raise NotImplementedError

    def _abort_running(self) -> None:
        """End every request in the batch with an ``abort`` delta and empty the batch (worker thread)."""
        raise NotImplementedError

    def _weights_changed(self, cmd: Command) -> None:
        """After a weight command ran (worker thread); the engine drops what the old weights cached."""

    def _drop_cache(self) -> int:
        """Drop the KV kept between calls (a prefix cache; worker thread); how many entries went.
        Calls in the batch keep theirs. The default: an engine that keeps none."""
        return 0

    def _check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raises ``EngineError`` when the engine is shut down or the prompt is empty."""
        if self._fault is not None:
            raise self._down_error()
        if self._closed:
            raise EngineError("the engine is shut down")
        if not prompt_ids:
            raise EngineError("empty prompt")

    # ---- async API -------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Generate to completion; see ``Engine.generate``."""
        return await collect(self.stream(prompt_ids, sampling))

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncGenerator[TokenDelta, None]:
        """Yield one ``TokenDelta`` per sampled token; leaving the loop early cancels the request."""
        self._check_prompt(prompt_ids)
        req = self._new_request(
            [int(t) for t in prompt_ids],
            sampling,
            loop=asyncio.get_running_loop(),
            out=asyncio.Queue(),
            ending=Ending.of(self.eos_token_ids, sampling),
        )
        self._inbox.put(req)
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, EngineDownError):
                    raise EngineDownError(item.engine, item.reason)  # a fresh one per caller
                if isinstance(item, BaseException):
                    raise EngineError(f"generation failed: {type(item).__name__}: {item}") from item
                yield item
                if item.finish_reason:
                    return
        finally:
            req.cancelled = True  # no-op when finished; stops work when the client went away

    async def close(self) -> None:
        """Stop the worker; calls still open end with ``EngineError``."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join, 60)

    # ---- worker thread ---------------------------------------------------------------------

    def _serve_inbox(self) -> bool:
        """Take everything in the inbox: requests queue for the batch, commands run now. Waits for
        the first item when there is nothing to do (at most until a pause's deadline, which then
        expires). Returns False at shutdown, after ``_drain``."""
        ctl = self._control
        busy = (self._running() and ctl.decoding) or (self._waiting and ctl.admitting)
        for item in self._pull(block=not busy, timeout=ctl.seconds_left()):
            if item is None:
                self._drain()
                return False
            if isinstance(item, WorkerRequest):
                self._waiting.append(item)
            else:
                self._command(item)
        ctl.expire()
        return True

    def _pull(self, *, block: bool, timeout: float | None) -> list:
        """Everything in the inbox; when ``block``, waits for the first item (at most ``timeout`` s,
        and at most ``MAX_WAIT_SECONDS``: the caller's loop comes back for a longer deadline)."""
        items = []
        try:
            if block:
                wait = None if timeout is None else min(timeout, MAX_WAIT_SECONDS)
                items.append(self._inbox.get(timeout=wait))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            return items

    def _command(self, cmd: Command) -> None:
        """Run one control command between two steps; its caller gets the result or the error."""
        ctl = self._control
        try:
            if cmd.kind == "pause":
                ctl.pause(cmd)  # answered by ctl.settle once it has taken effect
                if cmd.mode == "abort":
                    self._abort_running()  # the tokens sampled so far were emitted already
            elif cmd.kind == "resume":
                ctl.resume()
                cmd.future.set_result(None)
            elif cmd.kind == "run":
                assert cmd.apply is not None
                cmd.future.set_result(cmd.apply())
            else:
                version = ctl.new_weights(cmd, len(self._running()))
                self._weights_changed(cmd)
                cmd.future.set_result(version)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, never kills the worker
            if not cmd.future.done():
                cmd.future.set_exception(exc)

    def _drain(self) -> None:
        """At shutdown: every open call and command ends with ``EngineError``."""
        err = EngineError("the engine shut down during generation")
        self._control.fail_all(err)
        for r in [*self._running(), *self._waiting]:
            r.emit(err)
        self._waiting.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Command):
                item.future.set_exception(err)
            elif item is not None:
                item.emit(err)
