"""`gateway hub allocate`: the reference allocator (DESIGN §10), long-running.

It folds `llm.usage.v1`, `llm.policy.v1` and `llm.quota.v1` into a QuotaLedger (its whole
state: restarted, it reads them again from the beginning before it hands anything out),
and every `interval_s`, or at once when a spoke's report frees a share, publishes the
allowances that changed. Kafka away: it keeps what it has not sent and sends the newest
once Kafka is back; spokes keep enforcing what they hold meanwhile.

Several may run (two deployments, a rolling update's overlap): each heartbeats on
`llm.quota.v1` and only the newest-started live one publishes; the others fold the topics
as a warm standby and take over, continuing its generations, within 3 of its intervals
after its heartbeats stop (at once when it stops cleanly). See gateway/hub/fence.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

from gateway.hub import fence
from gateway.hub import quota_topic as qt
from gateway.hub.quota_ledger import QuotaLedger
from gateway.hub.topics import start_consumer, stop_consumer
from gateway.log import log


class _Rebuild(Exception):
    """Withdrawn while holding allowances it had not sent: its ledger counts them issued."""


class Allocator:
    def __init__(self, bootstrap: str, interval_s: float = 5.0, idempotence: bool = True,
                 usage_topic: str = qt.USAGE_TOPIC, retry_s: float = 1.0,
                 allocator_id: str | None = None, replication: int = 1) -> None:
        self.bootstrap = bootstrap
        self.interval_s = interval_s
        self.idempotence = idempotence
        self.replication = replication  # llm.quota.v1's, if this allocator creates it
        self.usage_topic = usage_topic
        self.retry_s = retry_s
        self.ledger = QuotaLedger()
        self._unsent: dict[str, dict[str, Any]] = {}  # spoke → its newest allowances
        self.published = 0
        self._failing = False
        self.id = allocator_id or fence.new_id()
        self.fence = fence.Fence(fence.Heartbeat(self.id, time.time(), interval_s, False))
        self.ready = False  # it may publish: it claims, and read the topic to its end since
        self._logged: tuple[str, str] = ("", "")  # the last state logged (each once)
        self._beat_failing = False
        self._others_wrote = False  # another allocator's allowance read while not ready
        self._foreign: set[str | None] = set()  # writers seen while ready (logged once)

    def fold(self, m: Any) -> bool:
        """One record of any of the three topics into the ledger (an allocator's heartbeat
        into the fence); True if it frees a share."""
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
        other = fence.parse_heartbeat_key(m.key)
        if other is not None:
            self.fence.on_heartbeat(other, qt.decode(m.value), time.monotonic())
            return False
        kind = qt.parse_key(m.key)
        msg = qt.decode(m.value)
        if kind is None or msg is None:
            return False
        try:
            if kind[0] == "applied":
                return self.ledger.on_applied(kind[1], msg)
            self.ledger.on_allowance(kind[1], msg)
            self._other_wrote(msg, kind[1])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("quota_message_unreadable", key=m.key.decode(errors="replace"),
                        error=str(exc))
        return False

    def _other_wrote(self, msg: dict[str, Any], spoke: str) -> None:
        """An allowance another allocator wrote: while this one publishes, a fault (an
        allocator of a version before the fence, or one that stalled past its lease)."""
        writer = msg.get("allocator")
        if writer == self.id:
            return
        if not self.ready:
            self._others_wrote = True
        elif writer not in self._foreign:
            self._foreign.add(writer)
            log.error("quota_allocator_foreign_allowance", id=self.id, spoke=spoke,
                      generation=msg.get("generation"),
                      writer=writer or "an allocator of a version without the fence")

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self._run(stop)
            except _Rebuild:
                self.ledger = QuotaLedger()  # it held allowances never sent: read again
            except qt.KAFKA_ERRORS as exc:
                log.error("quota_allocator_kafka_unavailable", error=repr(exc),
                          retry_s=self.retry_s)
                await qt.pause(stop, self.retry_s)

    async def _run(self, stop: asyncio.Event) -> None:
        c = qt.consumer(self.bootstrap, self.usage_topic, qt.POLICY_TOPIC, qt.QUOTA_TOPIC)
        await start_consumer(c)
        pub = qt.QuotaPublisher(self.bootstrap, self.idempotence,
                                replication=self.replication)
        self._claim(False)
        self.ready = False
        try:
            await qt.read_until_caught_up(c, self.fold)
            log.info("quota_allocator_resumed", id=self.id,
                     generation=self.ledger.generation,
                     spokes=sorted(self.ledger.spokes), quotas=len(self.ledger.quotas()))
            due = 0.0
            beat_due = 0.0
            async for batch in qt.batches(c):
                now_due = any([self.fold(m) for m in batch])
                if not stop.is_set():  # stopping, it takes over from no one
                    beat_due = await self._decide(c, pub, beat_due)
                if self.ready and (now_due or time.monotonic() >= due):
                    self._unsent.update(self.ledger.next_round(time.time()))
                    due = time.monotonic() + self.interval_s
                if self.ready:
                    await self._send(pub)
                if stop.is_set():
                    return
        finally:
            if stop.is_set():  # stopped, not failed: the others need not wait it out
                with contextlib.suppress(*qt.KAFKA_ERRORS):
                    async with asyncio.timeout(5.0):
                        await pub.remove(fence.heartbeat_key(self.id))
            await pub.close()
            await stop_consumer(c)

    # --- the fence (gateway/hub/fence.py) ---------------------------------------------

    def _claim(self, active: bool) -> None:
        self.fence.me = dataclasses.replace(self.fence.me, active=active)

    async def _decide(self, c: Any, pub: qt.QuotaPublisher, beat_due: float) -> float:
        """Claim, withdraw, or become ready to publish, as the heartbeats read so far say;
        a heartbeat when one is due or the claim changed. Returns when the next is due."""
        now = time.monotonic()
        leader = self.fence.leader(now)
        if self.fence.me.active and leader.id != self.id:
            self._claim(False)
            await self._heartbeat(pub, leader.id)
            self._withdraw(leader)
            return time.monotonic() + self.interval_s
        if not self.fence.me.active and leader.id == self.id:
            self._claim(True)
            await self._heartbeat(pub, leader.id)
            beat_due = time.monotonic() + self.interval_s
        elif now >= beat_due:
            await self._heartbeat(pub, leader.id)
            beat_due = time.monotonic() + self.interval_s
            if not self.fence.me.active:  # a standby's ledger forgets too (next_round's
                self.ledger.forget_before(time.time())  # does it for the active one)
        if not self.fence.me.active:
            if self._logged != ("standby", leader.id):
                self._logged = ("standby", leader.id)
                log.info("quota_allocator_standby", id=self.id, active=leader.id,
                         active_started=qt.rfc3339(leader.started))
            return beat_due
        if self.ready and not self.fence.may_publish(time.monotonic()):
            self.ready = False
            log.warning("quota_allocator_paused", id=self.id,
                        claimants=sorted(h.id for h in self.fence.claimants(now)),
                        lease=self.fence.leased(now))
        if not self.ready and self.fence.may_publish(time.monotonic()):
            # what was written before the last claim withdrawn (and before ours) is read
            await qt.read_to_end(c, self.fold)
            if self.fence.may_publish(time.monotonic()):
                if self._unsent and self._others_wrote:  # kept through an outage, while
                    self._unsent.clear()  # another published: the ledger is read again
                    raise _Rebuild
                self._others_wrote = False
                self.ready = True
                self._logged = ("active", self.id)
                log.info("quota_allocator_active", id=self.id,
                         generation=self.ledger.generation,
                         standby=sorted(h.id for h in self.fence.live(time.monotonic())))
        if not self.ready and self._logged != ("waiting", self.id):
            self._logged = ("waiting", self.id)
            log.info("quota_allocator_waiting", id=self.id,
                     claimants=sorted(h.id for h in self.fence.claimants(now)))
        return beat_due

    def _withdraw(self, leader: fence.Heartbeat) -> None:
        self.ready = False
        self._logged = ("standby", leader.id)
        log.warning("quota_allocator_standby", id=self.id, active=leader.id,
                    active_started=qt.rfc3339(leader.started), unsent=sorted(self._unsent))
        if self._unsent:  # issued in the ledger, never sent: the ledger is read again
            self._unsent.clear()
            raise _Rebuild

    async def _heartbeat(self, pub: qt.QuotaPublisher, leader: str) -> None:
        sent = time.monotonic()
        try:
            await pub.publish(fence.heartbeat_key(self.id),
                              self.fence.me.message(leader, self.ledger.generation))
        except qt.KAFKA_ERRORS as exc:
            if not self._beat_failing:
                log.error("quota_allocator_heartbeat_not_sent", id=self.id, error=repr(exc))
            self._beat_failing = True
            return
        self._beat_failing = False
        self.fence.wrote(sent)

    async def _send(self, pub: qt.QuotaPublisher) -> None:
        for spoke, msg in sorted(self._unsent.items()):
            if not self.fence.may_publish(time.monotonic()):
                # stalled mid-send (a pause, a slow Kafka) past its lease: another may lead
                # by now. Kept; the next `_decide` pauses or withdraws it.
                return
            try:
                await pub.publish(qt.allowance_key(spoke), {**msg, "allocator": self.id})
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

