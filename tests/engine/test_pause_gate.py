"""Call.race: the abort pause ends a call in flight, and costs a call that is not aborted nothing
but an await in its own task (issue #30: a task per call and per streamed chunk was measurable)."""

from __future__ import annotations

import asyncio

import pytest

from gymserve.engine.pause_gate import Call, CallAborted, PauseGate


async def test_race_returns_the_result_in_the_callers_task():
    call = Call()
    seen: list[asyncio.Task] = []

    async def work() -> int:
        seen.append(asyncio.current_task())
        await asyncio.sleep(0)
        return 7

    assert await call.race(work()) == 7
    assert seen == [asyncio.current_task()]  # no task of its own


async def test_an_abort_pause_ends_the_call_in_flight_and_its_work_cleans_up():
    gate = PauseGate(name="test")
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.set()

    async def one() -> str:
        async with gate.call() as call:
            try:
                await call.race(work())
            except CallAborted:
                return "aborted"
        return "done"

    task = asyncio.ensure_future(one())
    await asyncio.sleep(0.01)
    await gate.pause("abort", timeout=5)
    assert await asyncio.wait_for(task, 5) == "aborted"
    assert cleaned.is_set()
    assert not task.cancelled() and asyncio.current_task().cancelling() == 0
    gate.close()


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    """Server shutdown or a client that left cancels the caller: that is not an abort."""
    call = Call()
    task = asyncio.ensure_future(call.race(asyncio.sleep(30)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not call.aborted.is_set()


async def test_race_after_the_abort_does_not_start_the_work():
    call = Call()
    call.abort()
    started = False

    async def work() -> None:
        nonlocal started
        started = True

    with pytest.raises(CallAborted):
        await call.race(work())
    assert not started
