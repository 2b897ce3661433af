"""`gateway usage consume`: read the usage topic into the billing database (manual offset
commits)."""

from __future__ import annotations

from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from gateway.billing.db import UsageDb
from gateway.log import log
from gateway.sinks.usage_proto import from_json


def usage_consumer(bootstrap: str, topic: str, group: str | None,
                   listener: ConsumerRebalanceListener | None = None) -> AIOKafkaConsumer:
    # earliest + committed offsets (Tansu's ListOffsets(latest) is wrong); its JoinGroup is
    # held for session/2, so a short session keeps start-up fast.
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", session_timeout_ms=6000, heartbeat_interval_ms=1000,
        max_poll_records=1000)
    consumer.subscribe([topic], listener=listener)
    return consumer


async def consume(bootstrap: str, topic: str, db_url: str, group: str = "gateway-billing",
                  stop_when: Callable[[int], bool] | None = None,
                  until_caught_up: bool = False) -> int:
    """Aggregate until stopped, until `stop_when(total_new)` says so, or (`until_caught_up`)
    once the topic has nothing more for this group. Returns the new events."""
    db = UsageDb(db_url)
    from_the_start = _FromTheStartWhileEmpty(db)
    consumer = from_the_start.consumer = usage_consumer(bootstrap, topic, group, from_the_start)
    await consumer.start()
    total = dups = 0
    try:
        while stop_when is None or not stop_when(total):
            batches = await consumer.getmany(timeout_ms=500, max_records=1000)
            events = [from_json(m.value) for msgs in batches.values() for m in msgs
                      if m.value is not None]
            if not events:
                if until_caught_up and await caught_up(consumer):
                    break
                continue
            got = db.ingest(events)  # dedup marks + aggregates: one transaction ...
            await consumer.commit()  # ... then the offsets
            total += got.new
            dups += got.duplicates
            log.info("usage_ingested", new=got.new, duplicates=got.duplicates,
                     total_new=total, total_duplicates=dups, behind=await _lag(consumer))
    finally:
        await consumer.stop()
        db.close()
    log.info("usage_consume_stopped", total_new=total, total_duplicates=dups)
    return total


class _FromTheStartWhileEmpty(ConsumerRebalanceListener):
    """A database `consume` never filled reads the topic from its start, whatever offsets
    the group committed (for another database: offsets live in Kafka, per group, not in the
    database). It would otherwise hold only what came after them, its report would miss the
    rest, and `reconcile` would report the events it never read as gaps. Its dedup marks make
    the re-read exact; once it holds an event, the group's offsets rule again."""

    consumer: AIOKafkaConsumer  # the consumer it listens to (set once made)

    def __init__(self, db: UsageDb) -> None:
        self.db = db

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        if assigned and not self.db.has_events():
            await self.consumer.seek_to_beginning(*assigned)


async def _lag(consumer: AIOKafkaConsumer) -> int | None:
    """Records between this consumer's position and the end of the topic, as the last
    fetches saw it (None until every partition has been fetched once)."""
    behind = 0
    for tp in consumer.assignment():
        high = consumer.highwater(tp)
        if high is None:
            return None
        behind += max(0, high - await consumer.position(tp))
    return behind


async def caught_up(consumer: AIOKafkaConsumer) -> bool:
    return bool(consumer.assignment()) and await _lag(consumer) == 0
