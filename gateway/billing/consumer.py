"""`gateway usage consume` and `tail`: read the usage topic (manual offset commits)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer

from gateway.billing.db import UsageDb
from gateway.log import log
from gateway.metering.events import from_json


def _consumer(bootstrap: str, topic: str, group: str | None) -> AIOKafkaConsumer:
    # earliest + committed offsets (Tansu's ListOffsets(latest) is wrong); its JoinGroup is
    # held for session/2, so a short session keeps start-up fast.
    return AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", session_timeout_ms=6000, heartbeat_interval_ms=1000,
        max_poll_records=1000)


async def consume(bootstrap: str, topic: str, db_url: str, group: str = "gateway-billing",
                  stop_when: Callable[[int], bool] | None = None) -> int:
    """Aggregate until stopped (or until `stop_when(total_new)` says so). Returns new events."""
    db = UsageDb(db_url)
    consumer = _consumer(bootstrap, topic, group)
    await consumer.start()
    total = 0
    try:
        while stop_when is None or not stop_when(total):
            batches = await consumer.getmany(timeout_ms=500, max_records=1000)
            events = [from_json(m.value) for msgs in batches.values() for m in msgs
                      if m.value is not None]
            if not events:
                continue
            got = db.ingest(events)  # dedup marks + aggregates: one transaction ...
            await consumer.commit()  # ... then the offsets
            total += got.new
            log.info("usage_ingested", new=got.new, duplicates=got.duplicates)
    finally:
        await consumer.stop()
        db.close()
    return total


async def tail(bootstrap: str, topic: str, limit: int | None = None) -> None:
    consumer = _consumer(bootstrap, topic, None)
    await consumer.start()
    seen = 0
    try:
        async for msg in consumer:
            sys.stdout.write((msg.value or b"").decode() + "\n")
            sys.stdout.flush()
            seen += 1
            if limit is not None and seen >= limit:
                return
    finally:
        await consumer.stop()


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]
