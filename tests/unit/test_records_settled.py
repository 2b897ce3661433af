"""A batch of Envoy's records is answered only once its settlements reached the limiter
store: Envoy never sends an answered batch again, so a sidecar killed between the answer
and the settlement would leave the admission to the orphan sweep, its counter keeping the
reservation. A store that does not answer delays the answer by its wait (SETTLE_WAIT_S), no
more."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from gateway import metrics
from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.clock import SystemClock
from gateway.errors import StoreUnavailable
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.limits.types import Ending, Settle
from gateway.metering.recorder import Recorder
from gateway.server.records_service import RecordsService
from gateway.sinks.spool import Spool
from tests.unit.test_records_http import batch


class GatedStore(MemoryLimiter):
    """Endings wait for `gate`; `down` refuses them as an unreachable store would."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.down = False
        self.ended: list[Ending] = []

    async def end_many(self, ends: Sequence[Ending]) -> None:
        if self.down:
            raise StoreUnavailable("down")
        await self.gate.wait()
        self.ended.extend(ends)
        await super().end_many(ends)


def _request(*rids: str) -> otlp.ExportLogsServiceRequest:
    return otlp.ExportLogsServiceRequest.FromString(batch(*rids))


async def _service(tmp_path: Path, store: GatedStore,
                   settle_wait_s: float = 1.0) -> tuple[RecordsService, asyncio.Task[None]]:
    """The service (its ledger started) and its spool's writer."""
    spool = Spool(tmp_path, "i").open()
    ledger = Ledger(store, SystemClock(), 30.0)
    ledger.start()
    service = RecordsService(Recorder(spool, "s", ledger), ledger, settle_wait_s=settle_wait_s)
    return service, asyncio.create_task(spool.run_writer())


async def test_a_batch_is_answered_once_its_settlements_reached_the_store(
        tmp_path: Path) -> None:
    store = GatedStore()
    service, writer = await _service(tmp_path, store)
    exporting = asyncio.create_task(service.export(_request("r1")))
    try:
        await asyncio.sleep(0.2)
        # durable, not yet settled
        assert service.recorder.spool.durable_seq == 1 and not exporting.done()
        store.gate.set()
        await asyncio.wait_for(exporting, 2)
        assert store.ended == [Settle("r1", 19)]  # 9 prompt + 10 completion tokens
    finally:
        writer.cancel()
        await service.ledger.stop()


async def test_a_store_that_does_not_answer_delays_the_answer_only_so_long(
        tmp_path: Path) -> None:
    store = GatedStore()
    store.down = True
    before = metrics.RECORDS_ANSWERED_UNSETTLED._value.get()
    service, writer = await _service(tmp_path, store, settle_wait_s=0.3)
    try:
        await asyncio.wait_for(service.export(_request("r1")), 2)
        assert metrics.RECORDS_ANSWERED_UNSETTLED._value.get() == before + 1
        assert store.ended == []
        # A batch that queues nothing (the same again, as Envoy's retry) waits for nothing.
        await asyncio.wait_for(service.export(_request("r1")), 0.1)
        store.down = False  # back: the settlement was kept, and goes now
        store.gate.set()
        assert await service.ledger.outbox.sent(2)
        assert store.ended == [Settle("r1", 19)]
    finally:
        writer.cancel()
        await service.ledger.stop()
