"""cancel_all ends tasks that a library kept alive through a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from gateway import log as gateway_log
from gateway.tasks import cancel_all, watched


async def _swallows_one_cancel(ticks: list[int]) -> None:
    """Like a loop whose Redis call swallowed the cancellation (redis-py 8.1 does, now and
    then): the first CancelledError is eaten, the loop goes on."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
        ticks.append(1)


async def test_a_task_that_swallowed_a_cancel_is_cancelled_again() -> None:
    ticks: list[int] = []
    task = asyncio.create_task(_swallows_one_cancel(ticks))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(cancel_all([task]), 2)
    assert task.cancelled()


async def test_one_cancel_alone_would_not_end_it() -> None:
    ticks: list[int] = []
    task = asyncio.create_task(_swallows_one_cancel(ticks))
    await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=0.2)
    assert not done  # what `stop()` used to wait for, for ever
    await cancel_all([task])


async def test_ended_and_failed_tasks_are_collected() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fails())
    finished = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    await cancel_all([failed, finished])
    assert failed.done() and finished.done()


async def _dies() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("boom")


async def _cancelled_forever() -> None:
    await asyncio.sleep(3600)


async def test_a_background_task_that_crashes_is_logged_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Not when the task is collected: a loop that died silently once left the store's
    gauge and health stuck at their last values."""
    gateway_log.configure("info", cache=False)
    task = watched(_dies(), "watch")
    await asyncio.wait([task])
    await asyncio.sleep(0)  # done callbacks run on the next turn
    err = capsys.readouterr().err
    assert '"background_task_crashed"' in err and '"task": "watch"' in err, err
    assert "RuntimeError" in err and "boom" in err
    quiet = watched(_cancelled_forever(), "quiet")  # a stop is no crash
    await asyncio.sleep(0)
    await cancel_all([quiet])
    await asyncio.sleep(0)
    assert "background_task_crashed" not in capsys.readouterr().err
