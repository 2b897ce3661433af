"""The denial cap (recorder.DENIED_HELD_MAX) counts every event the spool holds in memory,
also the group its writer is trying to write again. While a retry's write is in progress
(a failing disk can take long to refuse), that group is out of the queue: counted from the
queue alone, the held events read as none, and denials were kept without a cap meanwhile."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.metering import recorder as recorder_module
from gateway.metering.billing import settle
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.metering.recorder import Recorder
from gateway.sinks.spool import Spool

T = TypeVar("T")


def _denial(rid: str) -> RequestFacts:
    return RequestFacts(request_id=rid, key_id="k", team="t", model="m",
                        endpoint="/v1/chat/completions", denied_status=503)


def _emit(rec: Recorder, rid: str) -> int:
    facts = _denial(rid)
    return rec.emit(facts, settle(facts, ResponseFacts(status=503, ended=True)), 0.0, 0.0).seq


async def test_the_group_being_written_counts_toward_the_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "DENIED_HELD_MAX", 3)
    spool = Spool(tmp_path, "i1").open()
    rec = Recorder(spool, "s", Ledger(MemoryLimiter(), SystemClock(), 30.0))
    assert [_emit(rec, f"d{i}") for i in range(3)] == [1, 2, 3]
    spool.gate.set(True, "No space left on device")  # an earlier group commit failed
    writing, refuse = asyncio.Event(), asyncio.Event()

    async def failing_disk(fn: Callable[[], T]) -> T:
        writing.set()
        await refuse.wait()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool, "on_disk_thread", failing_disk)
    retry = asyncio.create_task(spool.commit())
    await writing.wait()
    assert spool.in_memory == 3  # the group being written again is still held
    assert _emit(rec, "during") == 0  # at the cap: dropped
    refuse.set()
    with pytest.raises(OSError):
        await retry
    assert spool.in_memory == 3
    spool.close()
