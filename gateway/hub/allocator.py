"""`gateway hub allocate`: the reference allocator (DESIGN §10), long-running.

It folds `llm.usage.v1`, `llm.policy.v1` and `llm.quota.v1` into a QuotaLedger (its whole
state: restarted, it reads them again from the beginning before it hands anything out),
and every `interval_s`, or at once when a spoke's report frees a share, publishes the
allowances that changed. Kafka away: it keeps what it has not sent and sends the newest
once Kafka is back; spokes keep enforcing what they hold meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.hub import quota_topic as qt
from gateway.hub.quota_ledger import QuotaLedger
from gateway.hub.topics import start_consumer, stop_consumer
from gateway.log import log


class Allocator:
    def __init__(self, bootstrap: str, interval_s: float = 5.0, idempotence: bool = True,
                 usage_topic: str = qt.USAGE_TOPIC, retry_s: float = 1.0) -> None:
        self.bootstrap = bootstrap
        self.interval_s = interval_s
        self.idempotence = idempotence
        self.usage_topic = usage_topic
        self.retry_s = retry_s
        self.ledger = QuotaLedger()
        self._unsent: dict[str, dict[str, Any]] = {}  # spoke → its newest allowances
        self.published = 0
        self._failing = False

    def fold(self, m: Any) -> bool:
        """One record of any of the three topics into the ledger; True if it frees a share."""
        if m.topic == self.usage_topic:
            event = qt.decode(m.value)
            if event is not None:
                self.ledger.on_usage(event)
            return False
        if m.topic == qt.POLICY_TOPIC:
            if m.key:
                value = qt.decode(m.value)
                if m.value and value is None:
                    log.warning("quota_policy_unreadable", feed_key=m.key.decode(errors="replace"))
                else:
                    self.ledger.on_policy(m.key.decode(errors="replace"), value)
            return False
        kind = qt.parse_key(m.key)
        msg = qt.decode(m.value)
        if kind is None or msg is None:
            return False
        try:
            if kind[0] == "applied":
                return self.ledger.on_applied(kind[1], msg)
            self.ledger.on_allowance(kind[1], msg)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("quota_message_unreadable", key=m.key.decode(errors="replace"),
                        error=str(exc))
        return False

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self._run(stop)
            except qt.KAFKA_ERRORS as exc:
                log.error("quota_allocator_kafka_unavailable", error=repr(exc),
                          retry_s=self.retry_s)
                await qt.pause(stop, self.retry_s)

    async def _run(self, stop: asyncio.Event) -> None:
        c = qt.consumer(self.bootstrap, self.usage_topic, qt.POLICY_TOPIC, qt.QUOTA_TOPIC)
        await start_consumer(c)
        pub = qt.QuotaPublisher(self.bootstrap, self.idempotence)
        try:
            await qt.read_until_caught_up(c, self.fold)
            log.info("quota_allocator_resumed", generation=self.ledger.generation,
                     spokes=sorted(self.ledger.spokes), quotas=len(self.ledger.quotas()))
            due = 0.0
            async for batch in qt.batches(c):
                now_due = any([self.fold(m) for m in batch])
                if now_due or time.monotonic() >= due:
                    self._unsent.update(self.ledger.next_round(time.time()))
                    due = time.monotonic() + self.interval_s
                await self._send(pub)
                if stop.is_set():
                    return
        finally:
            await pub.close()
            await stop_consumer(c)

    async def _send(self, pub: qt.QuotaPublisher) -> None:
        for spoke, msg in sorted(self._unsent.items()):
            try:
                await pub.publish(qt.allowance_key(spoke), msg)
            except qt.KAFKA_ERRORS as exc:
                if not self._failing:  # once per outage, not once per poll
                    log.error("quota_allowances_not_sent", spokes=sorted(self._unsent),
                              error=repr(exc))
                self._failing = True
                return  # kept: sent once Kafka is back (the newest per spoke)
            self._failing = False
            del self._unsent[spoke]
            self.published += 1
            log.info("quota_allowance_published", spoke=spoke, generation=msg["generation"],
                     allowances={f"{e['scope']}/{e['period_id']}": e["allowance"]
                                 for e in msg["allowances"]})

