"""The orphan sweeper's pacing when the event loop was held (a GC pause, SIGSTOP, a
starved CPU): its overdue round is skipped, so the renewals and the streams' messages that
waited meanwhile go first. A ledger that records when it is asked to sweep stands in for
the store (tests/integration/test_sweep_after_outage.py is the proof over a real Redis)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from gateway.limits.types import Orphan
from gateway.metering.recorder import Recorder
from gateway.sinks.spool import Spool

INTERVAL = 0.1


class Asked:
    """A ledger that records when each sweep is asked for, and has nothing to claim."""

    watches = False
    unheard_s = 0.0

    def __init__(self) -> None:
        self.at: list[float] = []

    async def sweep(self, now: float, limit: int) -> list[Orphan]:
        self.at.append(time.monotonic())
        return []


async def _until(done: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < end, what
        await asyncio.sleep(INTERVAL / 10)


async def test_a_round_due_while_the_loop_was_held_waits_an_interval(tmp_path: Path) -> None:
    ledger = Asked()
    rec = Recorder(Spool(tmp_path, "unused"), "spoke", ledger)  # type: ignore[arg-type]
    sweeper = asyncio.create_task(rec.run_sweeper(INTERVAL))
    try:
        # on time, a round an interval (polled: a loaded machine wakes the loop late, and
        # a round over half an interval late is skipped, as this test's second half wants)
        await _until(lambda: len(ledger.at) >= 2, "no two rounds")
        time.sleep(INTERVAL * 4)  # the loop held: every lease renewed here may have run out
        resumed = time.monotonic()
        await _until(lambda: any(t >= resumed for t in ledger.at), "the sweeper stopped")
        after = [t - resumed for t in ledger.at if t >= resumed]
        assert after[0] >= INTERVAL * 0.9, f"swept {after[0]:.3f} s after the loop ran again"
    finally:
        sweeper.cancel()
