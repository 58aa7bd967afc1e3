"""Several engine calls for one request: the ``n`` choices of a chat or completions request, the
prompts of a batched completions request. Each choice is an engine call of its own (the engine
batches them); these two helpers run them together and stop them together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


async def run_all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """The results of ``calls`` in order; the first failure cancels the others (their engine work
    stops) and is raised, so a request never leaves generations running after it failed."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def interleave(streams: Sequence[AsyncIterator[dict[str, Any]]]) -> AsyncGenerator[dict[str, Any], None]:
    """The items of several async iterators as each produces them (the choices of an ``n > 1``
    stream, each an engine call of its own). The first error ends the whole stream; leaving early
    (client disconnect) cancels every stream, which cancels their generations."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield item
        finally:
            aclose = getattr(streams[0], "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=64)
    done = object()

    async def pump(i: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, exc))
            return
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            _, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()
