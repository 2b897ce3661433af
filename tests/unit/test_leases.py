"""Envoy-fed admissions are renewed only while Envoy says their request lives (heartbeats)."""

from __future__ import annotations

import asyncio

from gateway.clock import FakeClock
from gateway.limits.leases import Leases
from gateway.limits.memory import MemoryLimiter
from gateway.limits.types import AdmitRequest
from gateway.policy.model import LimitSpec, TierLimit

SLOT = TierLimit("key", "k", LimitSpec(concurrency=1))


async def admitted(lim: MemoryLimiter, rid: str, now: float) -> None:
    assert (await lim.admit(AdmitRequest(rid, (SLOT,), 0, now))).allowed


async def ticks(n: int = 3) -> None:
    await asyncio.sleep(0.06 * n)  # the renew loop's tick is 0.05 s here


async def test_a_watched_admission_nobody_reports_is_given_up_and_swept() -> None:
    """Envoy died (or lost the record): no heartbeat, so the lease is no longer renewed, it
    runs out, and the sweep frees the slot and bills the request."""
    clock = FakeClock()
    lim = MemoryLimiter(lease_ttl=0.15)
    leases = Leases(lim, clock, lease_ttl=0.15, unheard_s=1.0)
    leases.start()
    try:
        await admitted(lim, "lost", clock.now())
        leases.watch("lost")
        clock.advance(0.9)
        await ticks()
        assert "lost" in leases.active  # within unheard_s: still renewed
        assert await lim.sweep(clock.now()) == []
        clock.advance(0.2)  # past unheard_s without a word from Envoy
        await ticks()
        assert "lost" not in leases.active
        clock.advance(0.2)  # its last lease runs out
        [orphan] = await lim.sweep(clock.now())
        assert orphan.request_id == "lost"
    finally:
        await leases.stop()


async def test_heartbeats_keep_a_long_request_alive_with_its_usage_so_far() -> None:
    clock = FakeClock()
    lim = MemoryLimiter(lease_ttl=0.15)
    leases = Leases(lim, clock, lease_ttl=0.15, unheard_s=1.0)
    leases.start()
    try:
        await admitted(lim, "long", clock.now())
        leases.watch("long")
        for used in (10, 20, 30):  # a 2.4 s stream, heard every 0.8 s
            clock.advance(0.8)
            leases.heard("long", (5, used))
            await ticks()
            assert "long" in leases.active
        clock.advance(1.1)  # then silence: the sweep bills the last checkpoint
        await ticks()
        clock.advance(0.2)
        [orphan] = await lim.sweep(clock.now())
        assert (orphan.checkpoint, orphan.charged) == ((5, 30), 35)
    finally:
        await leases.stop()


async def test_a_heartbeat_adopts_an_admission_another_instance_made() -> None:
    """Admitted by a worker that since restarted (or another worker): whoever hears the
    heartbeat renews it; its end settles it there."""
    clock = FakeClock()
    lim = MemoryLimiter(lease_ttl=0.15)
    leases = Leases(lim, clock, lease_ttl=0.15, unheard_s=1.0)
    leases.start()
    try:
        await admitted(lim, "adopted", clock.now())
        leases.heard("adopted", None)
        clock.advance(0.5)
        await ticks()
        assert await lim.sweep(clock.now()) == []  # renewed from here
        leases.settle("adopted", 7)
        await ticks()
        assert "adopted" not in lim.held
    finally:
        await leases.stop()
