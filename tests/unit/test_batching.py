"""batching.Deadlines: one timer bounds how long every pending future may wait."""

from __future__ import annotations

import asyncio

import pytest

from gateway.batching import Deadlines


class Late(Exception):
    pass


async def test_pending_futures_fail_at_their_deadline_and_answered_ones_do_not() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(0.05, Late)
    answered, pending = loop.create_future(), loop.create_future()
    deadlines.add(answered)
    deadlines.add(pending)
    answered.set_result("ok")
    t0 = loop.time()
    with pytest.raises(Late):
        await pending
    assert 0.04 < loop.time() - t0 < 0.5
    assert answered.result() == "ok"


async def test_each_future_gets_its_own_deadline_from_when_it_was_added() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(0.1, Late)
    first = loop.create_future()
    deadlines.add(first)
    await asyncio.sleep(0.06)
    second = loop.create_future()
    deadlines.add(second)
    with pytest.raises(Late):
        await first
    assert not second.done()  # 0.04 s left: the timer re-armed for it
    t0 = loop.time()
    with pytest.raises(Late):
        await second
    assert 0.02 < loop.time() - t0 < 0.5


async def test_one_timer_at_a_time_however_many_futures() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(0.02, Late)
    futures = [loop.create_future() for _ in range(1000)]
    for f in futures:
        deadlines.add(f)
    assert deadlines._timer is not None
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert all(isinstance(r, Late) for r in results)
    assert deadlines._timer is None and not deadlines._pending  # nothing left armed or held
