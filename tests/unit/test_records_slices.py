"""A records batch lets the event loop through while it is read (records_service.SLICE_S),
while few Checks wait on the store: a Check that arrives meanwhile is answered after one
slice, not after the whole batch. Under load (more Checks waiting) it is read whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.metering.recorder import Recorder
from gateway.server import records_service
from gateway.server.records_service import RecordsService
from gateway.sinks.spool import Spool
from tests.unit.test_records_http import batch


@pytest.mark.parametrize(("slice_s", "waiting", "seen_midway"), [
    (0.0, 0, True), (0.0, records_service.SLICE_UP_TO, True),
    (0.0, records_service.SLICE_UP_TO + 1, False), (0.0, None, False), (60.0, 0, False)])
async def test_the_loop_runs_between_slices_of_a_batch_under_light_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slice_s: float, waiting: int | None,
        seen_midway: bool) -> None:
    monkeypatch.setattr(records_service, "SLICE_S", slice_s)
    spool = Spool(tmp_path, "i").open()
    ledger = Ledger(MemoryLimiter(), SystemClock(), 30.0)
    service = RecordsService(Recorder(spool, "s", ledger), ledger, checks_waiting=None
                             if waiting is None else lambda: waiting)
    rids = [f"r{i}" for i in range(6)]
    seen: list[int] = []

    async def check() -> None:  # a Check that came in while the batch was being read
        seen.append(spool.last_seq)

    ledger.start()
    writer = asyncio.create_task(spool.run_writer())
    exporting = asyncio.create_task(service.export(
        otlp.ExportLogsServiceRequest.FromString(batch(*rids))))
    await asyncio.sleep(0)  # the export starts, then the Check is ready
    checking = asyncio.create_task(check())
    await asyncio.wait_for(exporting, 5)
    await checking
    writer.cancel()
    await ledger.stop()
    assert spool.last_seq == len(rids)
    assert (0 < seen[0] < len(rids)) is seen_midway
