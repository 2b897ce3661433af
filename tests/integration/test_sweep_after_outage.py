"""State that expires while every sidecar of a spoke is down: the orphan sweep of the first
sidecar back must not claim a stream Envoy still serves (Envoy-fed metering), over a real
Redis."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Admitted, Orphan
from gateway.metering.recorder import Recorder
from gateway.policy.model import LimitSpec, TierLimit
from gateway.sinks.spool import Spool
from gateway.usage_event import UsageEvent

TIER = TierLimit("key", "k", LimitSpec(concurrency=10, tokens_per_day=1_000_000))
LEASE = 0.6  # renewed every 0.2 s
UNHEARD = 1.5  # Envoy's heartbeats: a request unheard this long is given up
GRACE = 0.3


class Sweeps(Recorder):
    """The recorder's sweeper, its orphans collected instead of emitted."""

    def __init__(self, ledger: Ledger, tmp: Path) -> None:
        super().__init__(Spool(tmp, "unused"), "spoke", ledger)
        self.claimed: list[str] = []

    def orphan(self, o: Orphan) -> UsageEvent:  # type: ignore[override]
        self.claimed.append(o.request_id)
        return None  # type: ignore[return-value]


async def test_first_sweep_after_an_outage_waits_for_envoys_heartbeats(
        redis_url: str, tmp_path: Path) -> None:
    """Every sidecar was down for minutes: the leases of two requests admitted before ran
    out long ago. One still streams through Envoy (its heartbeats resume a moment after
    the restart), the other died with its client. The restarted sidecar's sweeper claims
    only the dead one: the live one is not billed from its checkpoint, nor its slot freed,
    nor its real event later dropped as a duplicate of an orphan event."""
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=LEASE, start_ttl=LEASE)
    db = redis.Redis.from_url(redis_url)
    before = time.time() - 300  # admitted five minutes ago; no sidecar renewed since
    for rid in ("live", "dead"):
        v = await lim.admit(AdmitRequest(rid, (TIER,), 100, before))
        assert isinstance(v, Admitted) and v.owes_settlement
    ledger = Ledger(lim, SystemClock(), LEASE, LEASE, watches=True, unheard_s=UNHEARD)
    ledger.start()
    rec = Sweeps(ledger, tmp_path)
    sweeper = asyncio.create_task(rec.run_sweeper(LEASE / 3, GRACE))
    try:
        start = time.monotonic()
        await asyncio.sleep(0.25)  # Envoy reconnects; its heartbeats of "live" resume
        # Heard past UNHEARD + 1 s, and on until the sweeper claimed "dead" (unheard 1.5 s,
        # + grace, at a 0.2 s sweep: ~2 s alone, later on a loaded machine), 15 s at most.
        while (time.monotonic() - start < UNHEARD + 1.0
               or ("dead" not in rec.claimed and time.monotonic() - start < 15)):
            ledger.heard("live", (10, 20))
            await asyncio.sleep(0.3)
        assert "live" not in rec.claimed
        assert rec.claimed == ["dead"]  # the sweeper still frees what nobody hears
        assert db.hexists("gw:req:live", "r")  # still held, renewed
        assert db.zscore("gw:reqs", "live") > time.time() * 1000
    finally:
        sweeper.cancel()
        await ledger.stop()
        await lim.close()
        db.close()


async def test_a_stream_whose_lease_ran_out_while_the_loop_was_held_is_not_claimed(
        redis_url: str, tmp_path: Path) -> None:
    """ext_proc metering: a stream begun here is renewed by this process alone. The event
    loop held for over a lease (a sidecar paused under load, found by the fault tests: its
    stream had an orphan event of no tokens, then its real one, which the consumer drops as
    the duplicate) lets the lease run out; once the loop runs again, the renewal comes
    before any sweep, and the stream stays held."""
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=LEASE, start_ttl=LEASE)
    db = redis.Redis.from_url(redis_url)
    v = await lim.admit(AdmitRequest("paused", (TIER,), 100, time.time()))
    assert isinstance(v, Admitted) and v.owes_settlement
    ledger = Ledger(lim, SystemClock(), LEASE, LEASE)
    ledger.start()
    ledger.admitted("paused")
    ledger.begun("paused", lambda: (10, 5))
    rec = Sweeps(ledger, tmp_path)
    sweeper = asyncio.create_task(rec.run_sweeper(LEASE / 3))
    try:
        await asyncio.sleep(LEASE)
        assert rec.claimed == []
        time.sleep(LEASE * 2)  # the loop held: the lease runs out in Redis
        assert db.zscore("gw:reqs", "paused") < time.time() * 1000
        # The loop runs again: polled until renewed (a renewal every 0.2 s; a loaded
        # machine's loop can take longer than the lease it once waited), then not claimed.
        deadline = time.monotonic() + 10
        await asyncio.sleep(LEASE)
        while db.zscore("gw:reqs", "paused") < time.time() * 1000:
            assert time.monotonic() < deadline, "never renewed"
            await asyncio.sleep(0.05)
        assert rec.claimed == []
        assert db.zscore("gw:reqs", "paused") > time.time() * 1000  # renewed
    finally:
        sweeper.cancel()
        await ledger.stop()
        await lim.close()
        db.close()
