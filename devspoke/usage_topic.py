"""Reading the usage topic back from its beginning: `gateway dev`'s demo event, and the
delivery checks of the tests and the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

USAGE_TOPIC = "llm.usage.v1"


async def read_topic(bootstrap: str, keep: Callable[[Any], bool],
                     done: Callable[[], bool] | None = None, *, timeout: float = 15.0,
                     settle: float = 0.5, poll_ms: int = 200, max_records: int | None = None,
                     topic: str = USAGE_TOPIC, **consumer_kw: Any) -> None:
    """Hand every message on `topic`, from the first, to `keep` (which says whether it
    counts), until `done()` holds and `settle` more seconds brought nothing that counts (so
    a duplicate would show), or until `timeout`. With `settle` 0 it returns once `done()`.

    `keep` gets aiokafka's ConsumerRecord (`.key`, `.value`, bytes); without `done` the
    whole `timeout` is read.
    """
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                **consumer_kw)
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=poll_ms, max_records=max_records)
            kept = sum(1 for msgs in batch.values() for m in msgs if keep(m))
            if done is None or not done():
                continue
            if settle <= 0:
                return
            if kept or quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle:
                return
    finally:
        await consumer.stop()


async def find_event(bootstrap: str, request_id: str, timeout: float = 10.0) -> bytes | None:
    """The usage event of one request (the message keyed by its id), or None by `timeout`."""
    found: list[bytes] = []

    def keep(m: Any) -> bool:
        if m.key == request_id.encode() and m.value and not found:
            found.append(m.value)
        return False

    await read_topic(bootstrap, keep, lambda: bool(found), timeout=timeout, settle=0,
                     poll_ms=300)
    return found[0] if found else None
