"""Drains a spool into a producer, in seq order, marking what the sink acknowledged.

At-least-once: a crash between the sink's ack and the delivered mark re-sends that batch;
consumers deduplicate by event_id. Nothing is dropped: on failure the same batch is
retried with backoff, loudly, while the spool grows on disk.
"""

from __future__ import annotations

import asyncio
import re
import time

import orjson

from gateway import metrics
from gateway.log import log
from gateway.sinks.producers import Producer, Record
from gateway.sinks.spool import Spool
from gateway.usage_event import CE_TYPE

# The head of every line `event_json` writes (its keys in this order, each value a string):
# the CloudEvents headers are read from it without parsing the whole event. A line that does
# not match (or has an escape in those values) is parsed instead.
_STR = rb'"([^"\\]*)"'
_HEAD = re.compile(rb'\{"event_id":' + _STR + rb',"spoke":' + _STR + rb',"instance_id":' + _STR
                   + rb',"seq":"\d+","started_at":"[^"\\]*","ended_at":' + _STR)
_CE_TYPE = CE_TYPE.encode()


def record(line: bytes) -> Record:
    if m := _HEAD.match(line):
        event_id, spoke, instance, ended_at = m.groups()
    else:
        ev = orjson.loads(line)
        event_id, spoke, instance, ended_at = (
            str(ev.get(k, "")).encode() for k in ("event_id", "spoke", "instance_id", "ended_at"))
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", event_id),
        ("ce_source", b"/gateway/" + spoke + b"/" + instance),
        ("ce_type", _CE_TYPE),
        ("ce_time", ended_at),
        ("content-type", b"application/json"),
    ]
    return event_id, line, headers


def _records(spool: Spool, lines: list[tuple[int, bytes]]) -> list[Record]:
    """The batch's records. A line that is not an event (a byte flipped on disk) is sent as
    it is, keyed by instance:seq, and logged: the consumer quarantines it and `usage
    reconcile` lists it. Neither dropped nor a reason to retry the batch forever."""
    try:
        return [record(line) for _, line in lines]
    except (ValueError, AttributeError):  # JSONDecodeError is a ValueError
        pass
    out = []
    for seq, line in lines:
        try:
            out.append(record(line))
        except (ValueError, AttributeError) as exc:
            metrics.SPOOL_UNREADABLE.inc()
            log.error("spool_line_unreadable", instance=spool.instance_id, seq=seq,
                      bytes=len(line), error=repr(exc))
            out.append((f"{spool.instance_id}:{seq}".encode(), line,
                        [("content-type", b"application/octet-stream")]))
    return out


class Shipper:
    def __init__(self, spool: Spool, producer: Producer, batch: int = 1000,
                 linger: float = 0.1, persist_every: float = 0.2) -> None:
        self.spool = spool
        self.producer = producer
        self.batch = batch
        # A small batch waits this long for company: each Kafka produce request costs the
        # sidecar ~150-250 µs of CPU however few events it carries, so at 50 req/s 20 ms
        # meant one request per event or two. Billing reads the topic; it need not be sooner.
        self.linger = linger
        self.persist_every = persist_every  # the delivered mark hits the disk this often
        self._persisted_at = 0.0
        self._mark_failed_at = 0.0  # when a failed mark write was last logged (0: it works)

    async def _persist_due(self, now: float) -> bool:
        """Persist the delivered mark if `persist_every` has passed; whether it still has
        to be written (it changed since, and was not yet due). The write and rename run
        off the event loop: on a busy disk a rename can take milliseconds, and the Checks
        would wait for it."""
        if now - self._persisted_at >= self.persist_every:
            self._persisted_at = now
            if self.spool.delivered_unpersisted:
                mark = self.spool.delivered
                try:
                    await self.spool.on_disk_thread(lambda: self.spool.write_mark(mark))
                except OSError as exc:  # disk full, read-only, directory gone: the mark
                    # stays in memory (a restart re-sends, never loses) and is tried again
                    metrics.SPOOL_WRITE_ERRORS.inc()
                    if now - self._mark_failed_at >= 5.0:
                        self._mark_failed_at = now
                        log.error("spool_mark_write_failed", dir=str(self.spool.dir),
                                  delivered=mark, error=repr(exc))
                    return True
                self._mark_failed_at = 0.0
                self.spool.mark_written(mark)
            return False
        return self.spool.delivered_unpersisted

    async def run(self, until_empty: bool = False) -> None:
        """Deliver for ever; with `until_empty` (an adopted spool) until it is empty, then
        close it."""
        backoff = 0.1
        while True:
            try:
                lines = await self.spool.next_batch(self.batch)
            except OSError as exc:  # EIO, a segment removed: the same read again, loudly
                metrics.SPOOL_READ_ERRORS.inc()
                log.error("spool_read_failed", instance=self.spool.instance_id,
                          spool_depth=self.spool.depth, error=repr(exc), retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if not lines:
                if until_empty and self.spool.depth == 0:
                    self._persisted_at = 0.0  # due now
                    if not await self._persist_due(time.monotonic()):
                        # An adopted spool, delivered: its lock is given back, or its owner
                        # (the same pod name or worker, restarted) could never take it again.
                        self.spool.close()
                        log.info("adopted_spool_delivered", instance=self.spool.instance_id,
                                 delivered=self.spool.delivered)
                        return
                    await asyncio.sleep(self.persist_every)  # the mark failed: again
                    continue
                # Caught up. The delivered mark still hits the disk at most every
                # `persist_every` (a write and a rename each time the queue empties cost
                # ~6 % of the sidecar's CPU at ~100 req/s), and at the latest that long
                # after the last delivery when no new event comes.
                dirty = await self._persist_due(time.monotonic())
                self.spool.durable.clear()
                if self.spool.durable_seq > self.spool.delivered:  # made durable meanwhile
                    continue
                try:
                    await asyncio.wait_for(self.spool.durable.wait(),
                                           self.persist_every if dirty else None)
                except TimeoutError:
                    continue
                await asyncio.sleep(self.linger)
                continue
            try:
                await self.producer.send_batch(_records(self.spool, lines))
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
