"""until_disconnected: the model call runs in the handler's own task, a watcher cancels it when the
client leaves (issue #30: a second task and an asyncio.wait per call cost the gateway latency)."""

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


async def test_the_work_runs_in_the_callers_task_and_its_result_comes_back():
    seen = []

    async def work() -> str:
        seen.append(asyncio.current_task())
        await asyncio.sleep(0)
        return "answer"

    assert await until_disconnected(_Request(), work()) == "answer"
    assert seen == [asyncio.current_task()]
    assert asyncio.current_task().cancelling() == 0


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
