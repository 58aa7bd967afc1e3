"""A model call outlives no client: the backend call of a request is cancelled when its client
disconnects before the answer is ready.

Starlette cancels nothing when the client of a plain (non-streamed) response goes away: the handler
runs to its end and writes to a closed socket. For a model call that means a generation running for
up to ``max_tokens`` steps after a harness timed out, holding a batch slot, with every retry of that
harness adding another. vLLM's OpenAI server has the same guard (``with_cancellation`` in
``vllm/entrypoints/utils.py``: the handler raced against ``http.disconnect``). Streamed answers are
already stopped by Starlette's ``StreamingResponse`` once it has started; this covers the wait for
their first event too (a long prefill, ``n`` choices).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientLeft(Exception):  # noqa: N818 - a state, not an error of the server's
    """The client disconnected before its answer was ready; the work for it was cancelled."""


async def _disconnected(request: Request) -> None:
    """Return when the ASGI server reports ``http.disconnect`` (call after the body was read: the
    server then has nothing else to send on ``receive``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client of ``request`` disconnects first: then ``work`` is cancelled
    (and awaited, so its clean-up — an engine request marked cancelled, an upstream connection
    closed — has run) and ``ClientLeft`` is raised. The request's body must have been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is None:  # the client left first
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            if task.cancelled():
                raise ClientLeft()
        return await task
    finally:  # also when this coroutine itself is cancelled (server shutdown)
        watcher.cancel()
        task.cancel()
