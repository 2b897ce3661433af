"""The spoke's allowance follower (DESIGN §10): follows `llm.quota.v1` for its spoke and
writes the allocator's allowances where admission reads them, then reports what it applied
(`SPOKE/applied`), so the allocator can give a lowered share to another spoke.

Meant to run as one more task of `gateway policy sync`:

    follower = AllowanceFollower(bootstrap, spoke, redis_url=url, idempotence=...)
    await follower.run(stop)        # until `stop` is set; retries Kafka and Redis itself

`follower.state` says how it is doing: its `quota_gauges` on /metrics, and the syncer's row
of `policy status` (`run_sync(..., allowances=follower.state)`). Applying is
idempotent and never goes back to an older generation (gateway/limits/allowances.lua), so
a restart re-reads the topic from its beginning without harm. Run standalone for tests:
`python -m gateway.hub.allowances` (settings from env: GATEWAY_HUB_BOOTSTRAP or
GATEWAY_KAFKA_BOOTSTRAP, GATEWAY_SPOKE, GATEWAY_REDIS_URL, GATEWAY_KAFKA_IDEMPOTENCE,
GATEWAY_TOPIC_REPLICATION).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from gateway import metrics
from gateway.errors import StoreUnavailable
from gateway.hub import quota_topic as qt
from gateway.hub.topics import probe, stop_consumer
from gateway.limits.allowances import Allowance, AllowanceStore, Applied, RedisAllowances
from gateway.log import log

PROBE_S = 2.0  # how often Kafka and Redis are asked whether they answer (`state.*_up`)


@dataclass
class FollowerState:
    generation: int = 0  # the newest generation applied
    kafka_up: bool = False
    store_up: bool = True
    error: str = ""  # the last failure, until the next success
    applied_at: float = 0.0  # when `generation` was applied (unix time; 0: none yet)


def export(state: FollowerState) -> None:
    """/metrics reads `state` from now on (`metrics.quota_gauges`), whenever it is scraped:
    no copy to keep in step. One follower per process."""
    feed_up, store_up, generation, applied_at = metrics.quota_gauges()
    feed_up.set_function(lambda: 1 if state.kafka_up else 0)
    store_up.set_function(lambda: 1 if state.store_up else 0)
    generation.set_function(lambda: state.generation)
    applied_at.set_function(lambda: state.applied_at)


class AllowanceFollower:
    def __init__(self, bootstrap: str, spoke: str, redis_url: str | None = None, *,
                 store: AllowanceStore | None = None, idempotence: bool = True,
                 deadline: float = 0.25, retry_s: float = 1.0, replication: int = 1) -> None:
        if store is None:
            if not redis_url:
                raise ValueError("AllowanceFollower needs redis_url or store")
            from gateway.redis_clients import limiter_client
            store = RedisAllowances(limiter_client(redis_url, deadline))
        self.bootstrap = bootstrap
        self.spoke = spoke
        self.store = store
        self.idempotence = idempotence
        self.replication = replication  # llm.quota.v1's, if this follower creates it
        self.retry_s = retry_s
        self.state = FollowerState()
        export(self.state)  # on /metrics from the start: Kafka not yet answered
        self._latest: dict[str, Any] | None = None  # newest allowance message not yet applied
        self._taken: dict[str, Any] | None = None  # the message of `state.generation`
        self._report: dict[str, Any] | None = None  # newest report not yet sent
        self._retry_at = 0.0  # the store failed: not before then

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self._run(stop)
            except qt.KAFKA_ERRORS as exc:
                self._failed("kafka", exc)
                await qt.pause(stop, self.retry_s)

    async def _run(self, stop: asyncio.Event) -> None:
        c = qt.consumer(self.bootstrap, qt.QUOTA_TOPIC)
        pub = qt.QuotaPublisher(self.bootstrap, self.idempotence,
                                replication=self.replication)
        try:
            hello = {**self._message(0, []), "holds": await self._held_generation()}
            await pub.publish(qt.applied_key(self.spoke), hello)
            await c.start()
            self.state.kafka_up = True
            if self.state.error.startswith("kafka"):
                self.state.error = ""
            mine = qt.allowance_key(self.spoke)
            probed = time.monotonic()
            async for batch in qt.batches(c, poll_ms=100):
                for m in batch:
                    msg = qt.decode(m.value) if m.key == mine else None
                    if msg is not None:
                        self._latest = msg  # only the newest matters
                await self._apply()
                await self._send(pub)
                if stop.is_set():
                    return
                if time.monotonic() - probed >= PROBE_S:
                    await self.probe_store()  # a write alone would say only when one comes
                    await probe(c, 3.0)  # raises when Kafka is away: kafka_up is 0 till back
                    probed = time.monotonic()
        finally:
            self.state.kafka_up = False
            await pub.close()
            await stop_consumer(c)

    async def _apply(self) -> None:
        msg = self._latest
        if msg is None or time.monotonic() < self._retry_at:
            return
        try:
            report = await self.take(msg)
        except StoreUnavailable as exc:
            self._failed("store", exc)  # kept: applied once the store answers
            self._retry_at = time.monotonic() + self.retry_s
            return
        self._latest = None
        if report is not None:
            self._report = report

    async def take(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Apply one allowance message; the report to send up, or None (unreadable, or
        older than what the store holds: nothing written). Raises StoreUnavailable."""
        try:
            gen = int(msg["generation"])
            entries = [Allowance(str(e["scope"]), e["period"], str(e["period_id"]),
                                 int(e["allowance"]), int(e.get("used") or 0))
                       for e in msg["allowances"]]
            if any(e.period not in ("day", "month") or e.tokens < 0 or e.known < 0
                   for e in entries):
                raise ValueError("period must be day or month, allowance and used >= 0")
        except (KeyError, TypeError, ValueError) as exc:
            log.error("quota_allowance_unreadable", spoke=self.spoke, error=repr(exc))
            return None
        applied = await self.store.apply_allowances(gen, entries)
        self._store_answered()
        if applied is None:  # an older generation than the one held
            return None
        self.state.generation, self.state.applied_at, self.state.error = gen, time.time(), ""
        self._taken = msg
        log.info("quota_allowance_applied", spoke=self.spoke, generation=gen,
                 allowances={f"{a.scope}/{a.period_id}": a.allowance for a in applied})
        return self._message(gen, applied)

    async def _send(self, pub: qt.QuotaPublisher) -> None:
        if self._report is None:
            return
        await pub.publish(qt.applied_key(self.spoke), self._report)  # raises: kept, retried
        self._report = None

    async def _held_generation(self) -> int:
        """What the store holds, for the hello: an allocator that lost its topic starts
        its generations above it (else this spoke would refuse them all)."""
        try:
            held = await self.store.allowance_generation()
        except StoreUnavailable as exc:
            self._failed("store", exc)
            return 0
        self._store_answered()
        return held

    async def probe_store(self) -> None:
        """Ask the store whether it answers, so `store_up` goes to 0 when Redis goes away
        between allowances (most of the time: they come once per allocation).

        A store that answers with an older generation than the one this follower applied
        lost its allowances (Redis restarted empty, or from an older snapshot): the last
        one applied goes back at the next apply. The allocator publishes only when a
        spoke's allowances change, so without this the spoke would enforce its fallback
        share, perhaps larger than its allowance, until they next changed."""
        try:
            held = await self.store.allowance_generation()
        except StoreUnavailable as exc:
            self._failed("store", exc)
            return
        self._store_answered()
        if held < self.state.generation and self._taken is not None and self._latest is None:
            log.warning("quota_allowances_restored", spoke=self.spoke,
                        generation=self.state.generation, store_held=held)
            self._latest = self._taken

    def _store_answered(self) -> None:
        self.state.store_up = True
        if self.state.error.startswith("store"):
            self.state.error = ""

    def _message(self, generation: int, applied: list[Applied]) -> dict[str, Any]:
        return {"kind": "applied", "spoke": self.spoke, "generation": generation,
                "applied": [{"scope": a.scope, "period": a.period, "period_id": a.period_id,
                             "allowance": a.allowance, "used": a.used} for a in applied]}

    def _failed(self, what: str, exc: BaseException) -> None:
        if what == "store":
            self.state.store_up = False
        error = f"{what}: {exc!r}"
        if error != self.state.error:  # once per outage, not once per probe
            log.warning("quota_follower_retrying", spoke=self.spoke, error=error,
                        retry_s=self.retry_s)
        self.state.error = error


def main() -> None:
    """The follower alone, for tests and for spokes not yet running `policy sync`."""
    import argparse

    import uvloop

    from gateway.log import configure
    from gateway.settings import cli_settings
    s = cli_settings(argparse.Namespace())  # the env, validated as every command's
    configure(s.log_level)
    if s.feed_bootstrap is None or s.redis_url is None:
        raise SystemExit("gateway.hub.allowances: set GATEWAY_REDIS_URL and "
                         "GATEWAY_HUB_BOOTSTRAP or GATEWAY_KAFKA_BOOTSTRAP")
    follower = AllowanceFollower(s.feed_bootstrap, s.spoke, redis_url=s.redis_url,
                                 idempotence=s.kafka_idempotence,
                                 replication=s.topic_replication)
    uvloop.run(follower.run())


if __name__ == "__main__":
    main()
