"""`gateway usage consume`: read the usage topic into the billing database (manual offset
commits). A record it cannot read is quarantined with the batch, never a reason to stop:
one bad record would otherwise hold every later event back from billing, on every restart."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError
from google.protobuf.descriptor import FieldDescriptor

from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.billing.db import Rejected, UsageDb, unfit
from gateway.hub.topics import start_consumer
from gateway.log import log
from gateway.sinks.usage_proto import from_json

_ERROR_CHARS = 500  # of a parser's message kept (some quote the value)
_INTEGER = re.compile(r"-?[0-9]+")
_INT_TYPES = (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64,
              FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64)
_PREFIX_BYTES = 64  # of an unreadable value logged: enough to recognise, never a whole one


SESSION_TIMEOUT_S = 6.0  # `usage consume --session-timeout-s`'s default


def usage_consumer(bootstrap: str, topic: str, group: str | None,
                   listener: ConsumerRebalanceListener | None = None,
                   session_timeout_s: float = SESSION_TIMEOUT_S) -> AIOKafkaConsumer:
    # earliest + committed offsets (Tansu's ListOffsets(latest) is wrong); its JoinGroup is
    # held for session/2, so a short session keeps start-up fast. The session is also how
    # long a killed member's partitions wait before another takes them, and the longest a
    # batch's database write may hold the loop (and so the heartbeats, every session/6).
    session_ms = round(session_timeout_s * 1000)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", session_timeout_ms=session_ms,
        heartbeat_interval_ms=max(1, session_ms // 6), max_poll_records=1000)
    consumer.subscribe([topic], listener=listener)
    return consumer


async def consume(bootstrap: str, topic: str, db_url: str, group: str = "gateway-billing",
                  stop_when: Callable[[int], bool] | None = None,
                  until_caught_up: bool = False,
                  session_timeout_s: float = SESSION_TIMEOUT_S) -> int:
    """Aggregate until stopped, until `stop_when(total_new)` says so, or (`until_caught_up`)
    once the topic has nothing more for this group. Returns the new events."""
    db = UsageDb(db_url)
    from_the_start = _FromTheStartUntilRead(db)
    try:
        consumer = from_the_start.consumer = usage_consumer(
            bootstrap, topic, group, from_the_start, session_timeout_s)
        await start_consumer(consumer)
    except BaseException:
        db.close()
        raise
    total = dups = rejects = 0
    try:
        while stop_when is None or not stop_when(total):
            batches = await consumer.getmany(timeout_ms=500, max_records=1000)
            records = [m for msgs in batches.values() for m in msgs]
            if not records:
                if until_caught_up and await caught_up(consumer):
                    break
                continue
            events: list[usage_pb2.UsageEvent] = []
            rejected: list[Rejected] = []
            for m in records:
                read = read_record(m)
                if isinstance(read, Rejected):
                    rejected.append(read)
                else:
                    events.append(read)
            # dedup marks + aggregates + quarantine: one transaction ...
            got = db.ingest(events, rejected)
            if await _commit(consumer):  # ... then the offsets, then which are this db's
                db.mark_read([(tp.topic, tp.partition) for tp in batches])
            total += got.new
            dups += got.duplicates
            rejects += got.rejected
            log.info("usage_ingested", new=got.new, duplicates=got.duplicates,
                     rejected=got.rejected, total_new=total, total_duplicates=dups,
                     total_rejected=rejects, behind=await _lag(consumer))
    finally:
        await consumer.stop()
        db.close()
    log.info("usage_consume_stopped", total_new=total, total_duplicates=dups,
             total_rejected=rejects)
    return total


async def _commit(consumer: AIOKafkaConsumer) -> bool:
    """The offsets of what was read; refused when a rebalance took partitions away
    meanwhile. The batch is in the database either way: whoever owns those partitions now
    re-reads it from the last committed offsets and drops it as duplicates, so the consumer
    goes on, as a group member must through a rebalance."""
    try:
        await consumer.commit()
    except (CommitFailedError, IllegalStateError) as exc:
        log.warning("usage_offsets_not_committed", error=str(exc).split("\n")[0][:200],
                    note="the batch is in the database; its re-read will be duplicates")
        return False
    return True


def read_record(m: ConsumerRecord[bytes, bytes]) -> usage_pb2.UsageEvent | Rejected:
    """The record's event, or why it has none (logged: the operator must hear of it)."""
    value = m.value
    if value is None:
        error = "no value (a tombstone)"
    else:
        try:
            event = from_json(value)
        except Exception as exc:  # any: not JSON, not UTF-8, nested too deep, ...
            error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
        else:
            error = not_integer(usage_pb2.UsageEvent.DESCRIPTOR, json.loads(value)) or unfit(event)
            if not error:
                return event
    log.error("usage_record_unreadable", topic=m.topic, partition=m.partition,
              offset=m.offset, error=error, size=len(value or b""),
              prefix=(value or b"")[:_PREFIX_BYTES])
    return Rejected(m.topic, m.partition, m.offset, error, value or b"")


def not_integer(message: Any, obj: Any, at: str = "") -> str:
    """Why an integer field of the event's JSON (token counts, seq) is no integer ("" if
    each is one). The proto3 JSON parser also takes 10.0, 1e3 and "9007199254740993.0"
    through a float, which rounds a count past 2**53: a count is billed as sent or not."""
    if not isinstance(obj, dict):
        return ""
    for f in message.fields:
        value = obj.get(f.name, obj.get(f.json_name))
        if value is None or isinstance(value, list):  # unset; no repeated field is an int
            continue
        if f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if why := not_integer(f.message_type, value, f"{at}{f.name}."):
                return why
        elif f.cpp_type in _INT_TYPES and not (
                (isinstance(value, int) and not isinstance(value, bool))
                or (isinstance(value, str) and _INTEGER.fullmatch(value))):
            return f"{at}{f.name} {str(value)[:40]!r} is not an integer"
    return ""


class _FromTheStartUntilRead(ConsumerRebalanceListener):
    """A partition `consume` never read into this database is read from its start, whatever
    offsets the group committed (for another database: offsets live in Kafka, per group, not
    in the database). It would otherwise hold only what came after them, its report would
    miss the rest, and `reconcile` would report the events it never read as gaps. Its dedup
    marks make the re-read exact. A partition is marked read once a batch from it is in the
    database *and* its offsets are committed: only then are the group's offsets this
    database's (one killed between the two would otherwise resume at another database's
    offsets). Per partition, not per database: one killed after its first batch (from one
    partition), or given another partition by a rebalance, must still read the others from
    their start."""

    consumer: AIOKafkaConsumer  # the consumer it listens to (set once made)

    def __init__(self, db: UsageDb) -> None:
        self.db = db

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        unread = set(self.db.unread([(tp.topic, tp.partition) for tp in assigned]))
        fresh = [tp for tp in assigned if (tp.topic, tp.partition) in unread]
        if fresh:
            await self.consumer.seek_to_beginning(*fresh)


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
