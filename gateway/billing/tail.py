"""`gateway usage tail`: the events on the topic, in time order, like tail(1).

Kafka hands them over in partition order, and each instance's spool delivers on its own
schedule, so arrival order is not time order: events are sorted by when they ended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import orjson
from aiokafka import AIOKafkaConsumer

from gateway.billing.consumer import caught_up, usage_consumer
from gateway.hub.topics import start_consumer


def time_key(raw: bytes) -> tuple[str, str, int]:
    """(ended_at, instance_id, seq): RFC 3339 with milliseconds and Z compares as text in
    time order; an event that does not parse sorts first rather than being dropped."""
    try:
        e = orjson.loads(raw)
        return str(e.get("ended_at", "")), str(e.get("instance_id", "")), int(e.get("seq", 0))
    except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError):
        return "", "", 0


def last_in_time_order(raws: Iterable[bytes], n: int | None) -> list[bytes]:
    """The last `n` events by time (all of them when `n` is None), oldest first."""
    ordered = sorted(raws, key=time_key)
    return ordered if n is None else ordered[max(0, len(ordered) - n):] if n > 0 else []


def render(raw: bytes, pretty: bool) -> str:
    if pretty:
        with contextlib.suppress(orjson.JSONDecodeError):
            raw = orjson.dumps(orjson.loads(raw), option=orjson.OPT_INDENT_2)
    return raw.decode(errors="replace")


async def tail(bootstrap: str, topic: str, write: Callable[[str], None], last: int | None = None,
               follow: bool = False, pretty: bool = False) -> int:
    """Print the last `last` events there are (all, when None) in time order; with `follow`,
    then keep printing new ones, each batch in time order, until interrupted. Returns how
    many were printed."""
    consumer = usage_consumer(bootstrap, topic, None)
    await start_consumer(consumer)
    printed = 0
    try:
        seen: list[bytes] = []
        while True:  # the backlog: all of it, so the last N by time are the last N
            got = await _poll(consumer)
            seen += got
            if not got and await caught_up(consumer):
                break
        for raw in last_in_time_order(seen, last):
            write(render(raw, pretty))
            printed += 1
        while follow:
            for raw in last_in_time_order(await _poll(consumer), None):
                write(render(raw, pretty))
                printed += 1
    finally:
        await consumer.stop()
    return printed


async def _poll(consumer: AIOKafkaConsumer) -> list[bytes]:
    batches = await consumer.getmany(timeout_ms=500, max_records=1000)
    return [m.value for msgs in batches.values() for m in msgs if m.value]
