"""until_disconnected: the model call's answer, or ClientLeft once its client disconnects (the work
cancelled and cleaned up), and a server shutdown stays a cancellation.

Running the work in the handler's own task instead of a second one was tried for issue #30: 7 µs less
CPU per call alone, but 50 µs more per request through the gateway at concurrency 32 (measured in
interleaved rounds), so the two-task race stays."""

from __future__ import annotations

import asyncio

import pytest

from gymserve.server.disconnect import ClientLeft, until_disconnected


class _Request:
    """What until_disconnected reads of a Starlette request: ``receive`` (after the body)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, str]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_the_result_comes_back_when_the_client_stays():
    async def work() -> str:
        await asyncio.sleep(0)
        return "answer"

    assert await until_disconnected(_Request(), work()) == "answer"


async def test_a_client_that_leaves_cancels_the_work_and_raises_client_left():
    request = _Request()
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.set()

    async def handler() -> str:
        try:
            await until_disconnected(request, work())
        except ClientLeft:
            return "left"
        return "answered"

    task = asyncio.ensure_future(handler())
    await asyncio.sleep(0.01)
    request.gone.set()
    assert await asyncio.wait_for(task, 5) == "left"
    assert cleaned.is_set()


async def test_a_shutdown_cancellation_is_not_mistaken_for_a_client_that_left():
    task = asyncio.ensure_future(until_disconnected(_Request(), asyncio.sleep(30)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
