"""Envoy's batches while the spool's disk is full: none is answered before its events are
on disk, a batch Envoy sends again included (its records were recorded by the first
send, still only in memory): answered, Envoy would forget records a kill then loses."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from gateway.sinks.segments import Segments
from tests.unit.test_records_settled import GatedStore, _request, _service


async def test_a_batch_sent_again_waits_for_the_first_ones_events_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = GatedStore()
    store.gate.set()
    real = Segments.append
    full = [True]

    def append(self: Segments, first: int, data: bytes) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, first, data)

    monkeypatch.setattr(Segments, "append", append)
    service, writer = await _service(tmp_path, store)
    first = asyncio.create_task(service.export(_request("r1", "r2")))
    again = None
    try:
        await asyncio.sleep(0.2)
        assert not first.done()
        again = asyncio.create_task(service.export(_request("r1", "r2")))  # Envoy's retry
        await asyncio.sleep(0.3)
        assert not again.done(), "answered while its events were in memory only"
        full[0] = False
        await asyncio.wait_for(asyncio.gather(first, again), 5)
        assert service.recorder.spool.durable_seq == 2  # recorded once
    finally:
        for t in (first, again):
            if t is not None:
                t.cancel()
        writer.cancel()
        await service.ledger.stop()
