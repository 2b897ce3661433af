"""Drains a spool into a producer, in seq order, marking what the sink acknowledged.

At-least-once: a crash between the sink's ack and the delivered mark re-sends that batch;
consumers deduplicate by event_id. Nothing is dropped: on failure the same batch is
retried with backoff, loudly, while the spool grows on disk.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from gateway import metrics
from gateway.log import log
from gateway.sinks.producers import Producer, Record
from gateway.sinks.spool import Spool
from gateway.usage_event import CE_TYPE


def record(line: bytes) -> Record:
    ev = orjson.loads(line)
    event_id = str(ev.get("event_id", ""))
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", event_id.encode()),
        ("ce_source", f"/gateway/{ev.get('spoke', '')}/{ev.get('instance_id', '')}".encode()),
        ("ce_type", CE_TYPE.encode()),
        ("ce_time", str(ev.get("ended_at", "")).encode()),
        ("content-type", b"application/json"),
    ]
    return event_id.encode(), line, headers


class Shipper:
    def __init__(self, spool: Spool, producer: Producer, batch: int = 1000,
                 linger: float = 0.02, persist_every: float = 0.2) -> None:
        self.spool = spool
        self.producer = producer
        self.batch = batch
        self.linger = linger  # a small batch waits this long for company
        self.persist_every = persist_every  # the delivered mark hits the disk this often
        self._persisted_at = 0.0

    async def _persist_due(self, now: float) -> bool:
        """Persist the delivered mark if `persist_every` has passed; whether it still has
        to be written (it changed since, and was not yet due). The write and rename run
        off the event loop: on a busy disk a rename can take milliseconds, and the Checks
        would wait for it."""
        if now - self._persisted_at >= self.persist_every:
            if self.spool.delivered_unpersisted:
                mark = self.spool.delivered
                await asyncio.to_thread(self.spool.write_mark, mark)
                self.spool.mark_written(mark)
            self._persisted_at = now
            return False
        return self.spool.delivered_unpersisted

    async def run(self, until_empty: bool = False) -> None:
        backoff = 0.1
        while True:
            lines = self.spool.read_batch(self.batch)
            if not lines:
                if until_empty and self.spool.depth == 0:
                    self.spool.persist_delivered()
                    return
                # Caught up. The delivered mark still hits the disk at most every
                # `persist_every` (a write and a rename each time the queue empties cost
                # ~6 % of the sidecar's CPU at ~100 req/s), and at the latest that long
                # after the last delivery when no new event comes.
                dirty = await self._persist_due(time.monotonic())
                self.spool.durable.clear()
                if self.spool.read_batch(1):
                    continue
                try:
                    await asyncio.wait_for(self.spool.durable.wait(),
                                           self.persist_every if dirty else None)
                except TimeoutError:
                    continue
                await asyncio.sleep(self.linger)
                continue
            try:
                await self.producer.send_batch([record(line) for _, line in lines])
            except Exception as exc:  # SinkUnavailable, or anything: retry, never drop
                metrics.SINK_ERRORS.inc()
                log.error("usage_delivery_failed", spool_depth=self.spool.depth,
                          instance=self.spool.instance_id, error=repr(exc), retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self.spool.mark_delivered(lines[-1][0], persist=False)
            await self._persist_due(time.monotonic())
            metrics.EVENTS_DELIVERED.inc(len(lines))
