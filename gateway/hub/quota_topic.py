"""The Kafka side of one quota across spokes: `llm.quota.v1` (docs/contracts.md §9), and
reading the topics the allocator folds. All of this feature's Kafka I/O is here.

`llm.quota.v1` (compacted) carries two kinds of message, JSON:
* key `SPOKE`: the allocator's allowances for that spoke (down);
* key `SPOKE/applied`: that spoke's follower's report of what it applied (up);
* key `allocator/ID/heartbeat`: an allocator's heartbeat (gateway/hub/fence.py), read by allocators
  only: a spoke id holds no '/', and followers read their own key alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from gateway.errors import SinkUnavailable
from gateway.hub.topics import CompactedTopic
from gateway.sinks.producers import KafkaProducer
from gateway.usage_event import rfc3339

QUOTA_TOPIC = "llm.quota.v1"
POLICY_TOPIC = "llm.policy.v1"
USAGE_TOPIC = "llm.usage.v1"
APPLIED = "/applied"
KAFKA_ERRORS = (KafkaError, OSError, SinkUnavailable, asyncio.TimeoutError)


def allowance_key(spoke: str) -> bytes:
    return spoke.encode()


def applied_key(spoke: str) -> bytes:
    return (spoke + APPLIED).encode()


def parse_key(key: bytes | None) -> tuple[str, str] | None:
    """('allowance' | 'applied', spoke) of a quota-topic key; None if it is neither."""
    if not key:
        return None
    text = key.decode(errors="replace")
    if text.endswith(APPLIED):
        return "applied", text[: -len(APPLIED)]
    return ("allowance", text) if "/" not in text else None


def decode(value: bytes | None) -> dict[str, Any] | None:
    """A message's JSON object, or None (a tombstone, or not JSON: skipped, never fatal)."""
    if not value:
        return None
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class QuotaPublisher:
    """Produces to `llm.quota.v1` (acks=all). Raises SinkUnavailable while Kafka is away."""

    def __init__(self, bootstrap: str, idempotence: bool = True,
                 topic: str = QUOTA_TOPIC, replication: int = 1) -> None:
        self._producer = KafkaProducer(bootstrap, topic, idempotence)
        # its first writer creates it compacted, on `replication` brokers
        self._topic = CompactedTopic(bootstrap, topic, replication=replication)

    async def publish(self, key: bytes, msg: dict[str, Any]) -> None:
        await self._topic.ensure()
        body = {**msg, "at": rfc3339(time.time())}
        await self._producer.send_batch([(key, orjson.dumps(body), [])])

    async def remove(self, key: bytes) -> None:
        """A tombstone for `key` (compaction drops the key)."""
        await self._topic.ensure()
        await self._producer.send_batch([(key, None, [])])  # type: ignore[list-item]

    async def close(self) -> None:
        await self._producer.close()


def consumer(bootstrap: str, *topics: str) -> AIOKafkaConsumer:
    """From the first record, no group (every reader folds the whole topic; Tansu's
    'latest' is wrong: docs/kafka-broker.md), new partitions noticed within 2 s."""
    return AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=None,
                            enable_auto_commit=False, auto_offset_reset="earliest",
                            metadata_max_age_ms=2000)


async def caught_up(c: AIOKafkaConsumer) -> bool:
    """Every assigned partition read to its end, as the last fetches saw it."""
    parts = c.assignment()
    if not parts:
        return False
    for tp in parts:
        high = c.highwater(tp)
        if high is None or await c.position(tp) < high:
            return False
    return True


async def batches(c: AIOKafkaConsumer, poll_ms: int = 200,
                  ) -> AsyncIterator[list[Any]]:
    """The consumer's records, a batch per poll (possibly empty), in order per partition."""
    while True:
        got = await c.getmany(timeout_ms=poll_ms, max_records=1000)
        yield [m for msgs in got.values() for m in msgs]


async def read_until_caught_up(c: AIOKafkaConsumer, handle: Callable[[Any], object],
                               quiet_s: float = 2.0) -> None:
    """Hand every record to `handle` until the consumer is caught up (or nothing came for
    `quiet_s`: a topic nobody wrote yet has no partitions to be caught up on)."""
    last = time.monotonic()
    async for batch in batches(c):
        for m in batch:
            handle(m)
        if batch:
            last = time.monotonic()
        elif await caught_up(c) or time.monotonic() - last > quiet_s:
            return


async def read_to_end(c: AIOKafkaConsumer, handle: Callable[[Any], object],
                      topic: str = QUOTA_TOPIC) -> None:
    """Hand every record to `handle` up to the ends of the assigned partitions as the broker
    has them now (asked now, not as the last fetch saw them): whatever was acked before this
    call is read by its return. Waits till `topic` is assigned (a topic just created is
    noticed within the consumer's metadata age)."""
    async for batch in batches(c):
        for m in batch:
            handle(m)
        if any(tp.topic == topic for tp in c.assignment()):
            break
    ends = await c.end_offsets(list(c.assignment()))
    async for batch in batches(c):
        for m in batch:
            handle(m)
        if all([await c.position(tp) >= end for tp, end in ends.items()]):
            return


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `stop` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
