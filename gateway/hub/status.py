"""Status up (DESIGN §10): every `gateway serve` instance and every syncer reports on
`llm.gateway.status.v1`, keyed `SPOKE/INSTANCE`, on each revision it takes or refuses and
as a heartbeat every GATEWAY_STATUS_INTERVAL_S.

The report is built from a snapshot function, so what it says is what the reporter's owner
holds at the moment it is sent; a burst of changes is sent once, as its latest state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import orjson

from gateway import metrics
from gateway.errors import SinkUnavailable
from gateway.hub.topics import STATUS_TOPIC, CompactedTopic
from gateway.log import log
from gateway.sinks.producers import KafkaProducer

ERROR_MAX = 4000  # characters of a NACK's error a report carries


@dataclass(frozen=True)
class Status:
    """What one instance says about itself: the contract's fields, in its order."""

    spoke: str
    instance: str
    revision: int  # the revision it holds (serves, or holds in Redis for a syncer)
    state: str  # "ack" | "nack": whether it took the newest revision it was offered
    error: str | None  # the validation error of a nack
    at: str  # RFC 3339 UTC, when it was reported
    spool_depth: int
    spool_oldest_s: float
    limiter_store_up: bool

    @property
    def key(self) -> str:
        return f"{self.spoke}/{self.instance}"

    def encode(self) -> bytes:
        """The record; an error over ERROR_MAX characters is cut, saying how much: a revision
        refused for each of 30,000 keys makes a 1.3 MB error, over Kafka's default record
        limit (1 MB), and every report of the instance would be refused while it lasts."""
        data = asdict(self)
        if self.error is not None and len(self.error) > ERROR_MAX:
            kept = ERROR_MAX - 60
            data["error"] = (f"{self.error[:kept]} ... ({len(self.error) - kept} more "
                             "characters left out)")
        return orjson.dumps(data)


def rfc3339(ts: datetime) -> str:
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


def now_text() -> str:
    return rfc3339(datetime.now(UTC))


class StatusReporter:
    """Sends `snapshot()` on `poke()` (coalesced) and every `interval` seconds. Kafka away:
    the report is dropped (the next one says the same, newer) and counted; never raises."""

    def __init__(self, bootstrap: str, snapshot: Callable[[], Status], interval: float,
                 idempotence: bool = True, replication: int = 1) -> None:
        self.snapshot = snapshot
        self.interval = interval
        self.producer = KafkaProducer(bootstrap, STATUS_TOPIC, idempotence)
        self.topic = CompactedTopic(bootstrap, STATUS_TOPIC,  # created compacted
                                    replication=replication)
        self._wake = asyncio.Event()
        self.sent = 0

    def poke(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                self._wake.clear()
                await self.send_now()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval)
        finally:
            with contextlib.suppress(Exception):
                await self.producer.close()

    async def send_now(self) -> None:
        await self.topic.ensure()  # the first report creates the topic compacted
        status = self.snapshot()
        try:
            async with asyncio.timeout(max(self.interval, 5.0)):
                await self.producer.send_batch([(status.key.encode(), status.encode(), [])])
            self.sent += 1
        except (SinkUnavailable, TimeoutError) as exc:
            metrics.STATUS_SEND_ERRORS.inc()
            log.warning("hub_status_not_sent", key=status.key, error=str(exc))
            with contextlib.suppress(Exception):
                await self.producer.close()
