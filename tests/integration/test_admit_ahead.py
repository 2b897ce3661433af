"""Admitting ahead (gateway/limits/ahead.py) on a real Redis: a ticket is an admission made
early, and once a request takes it Redis holds what admitting that request would have
written; an unused ticket leaves nothing behind; small limits never get one; a lost
connection fails closed as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis

from devspoke.procs import free_port, redis_service
from gateway import metrics
from gateway.errors import StoreUnavailable
from gateway.limits.ahead import AheadLimiter, worth_a_ticket
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import TICKET, AdmitRequest, Admitted, Refused
from gateway.policy.model import LimitSpec, TierLimit

# The store's deadline, not under test here: room for a first connection and script load
# on a busy CI machine (the 250 ms default failed there once).
SLACK = 5.0

BIG = LimitSpec(rps=1000, burst=1000, concurrency=100, tokens_per_day=1_000_000)


def tiers(spec: LimitSpec = BIG) -> tuple[TierLimit, ...]:
    return (TierLimit("model", "m", spec), TierLimit("team", "t", spec),
            TierLimit("key", "k", spec))


def req(rid: str, ts: tuple[TierLimit, ...], reserve: int = 100) -> AdmitRequest:
    return AdmitRequest(rid, ts, reserve, time.time(), meta=f'["k","t","m","{rid}",false]')


def taken() -> float:
    return float(metrics.child(metrics.TICKETS, "taken")._value.get())


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:  # a wait, not a bound
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
async def ahead(redis_url: str) -> AsyncIterator[AheadLimiter]:
    lim = AheadLimiter(RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK), ttl=0.3)
    yield lim
    await lim.close()


def state(url: str) -> tuple[int, list[bytes], list[bytes], list[bytes]]:
    """The key tier's day counter, its concurrency set, the live admissions, the records."""
    r = redis.Redis.from_url(url)
    day = sum(int(r.get(k) or 0) for k in r.keys("gw:tpd:key:k:*"))
    return (day, sorted(r.zrange("gw:conc:key:k", 0, -1)), sorted(r.zrange("gw:reqs", 0, -1)),
            sorted(r.keys("gw:req:*")))


async def test_a_taken_ticket_becomes_the_requests_admission(ahead: AheadLimiter,
                                                             redis_url: str) -> None:
    ts = tiers()
    assert isinstance(await ahead.admit(req("r1", ts)), Admitted)  # through Redis
    await until(lambda: bool(ahead._shelf))  # the ticket for the next one
    before = taken()
    r2 = req("r2", ts, reserve=60)
    r2 = AdmitRequest(r2.request_id, ts, 60, r2.now + 5.5, r2.meta)  # later than its ticket
    got = await ahead.admit(r2)
    assert isinstance(got, Admitted) and got.owes_settlement
    assert taken() == before + 1
    await until(lambda: bool(ahead._shelf))  # bound, then the next ticket admitted
    day, conc, live, records = state(redis_url)
    # r1 and r2 with their own reservations (the ticket's 100 lowered to r2's 60), and the
    # next ticket's 60: what three plain admissions would hold
    assert day == 100 + 60 + 60
    names = {b"r1", b"r2"}
    assert names <= set(conc) and names <= set(live)
    assert {b"gw:req:r1", b"gw:req:r2"} <= set(records)
    assert len(conc) == len(live) == len(records) == 3  # the third is the new ticket
    r = redis.Redis.from_url(redis_url)
    assert r.hget("gw:req:r2", "r") == b"60"
    assert r.hget("gw:req:r2", "m") == b'["k","t","m","r2",false]'  # the orphan sweep's facts
    assert r.hget("gw:req:r2", "a") == str(int(r2.now * 1000)).encode()  # its own start
    await ahead.settle("r2", 7)  # settled by its request id, like any admission
    await ahead.settle("r1", 5)
    await until(lambda: state(redis_url)[0] == 5 + 7 + 60)


async def test_an_unused_ticket_leaves_nothing_behind(ahead: AheadLimiter,
                                                      redis_url: str) -> None:
    ts = tiers()
    await ahead.admit(req("r1", ts))
    await until(lambda: bool(ahead._shelf))
    assert state(redis_url)[0] == 200
    await until(lambda: not ahead._shelf)  # its 0.3 s ran out
    await until(lambda: state(redis_url) == (100, [b"r1"], [b"r1"], [b"gw:req:r1"]))


async def test_a_request_larger_than_the_ticket_goes_to_redis(ahead: AheadLimiter) -> None:
    ts = tiers()
    await ahead.admit(req("r1", ts, reserve=100))
    await until(lambda: bool(ahead._shelf))
    before = taken()
    assert isinstance(await ahead.admit(req("r2", ts, reserve=101)), Admitted)
    assert taken() == before


@pytest.mark.parametrize("spec", [
    LimitSpec(rps=10, burst=10),
    LimitSpec(concurrency=4),
    LimitSpec(tokens_per_day=1500),  # 15 reservations of 100
], ids=["burst", "concurrency", "tokens"])
async def test_small_limits_get_no_ticket_and_behave_as_without(spec: LimitSpec,
                                                                redis_url: str) -> None:
    ts = (TierLimit("key", "k", spec),)
    assert not worth_a_ticket(ts, 100)
    lim = AheadLimiter(RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK), ttl=5.0)
    try:
        await lim.admit(req("r1", ts))
        await asyncio.sleep(0.05)
        assert not lim._shelf and not lim._asking
    finally:
        await lim.close()


async def test_redis_refuses_a_ticket_that_would_crowd_a_limit(redis_url: str) -> None:
    """Past the Python floor, admit.lua keeps a quarter of every limit free of tickets: the
    enforced limits (an allowance among them) are only known there."""
    ts = (TierLimit("key", "k", LimitSpec(concurrency=16)),)
    inner = RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK)
    try:
        for i in range(11):
            assert isinstance(await inner.admit(req(f"r{i}", ts, 0)), Admitted)
        ok = await inner.admit(req(f"{TICKET}a", ts, 0))  # the 12th slot: 4 left free
        assert isinstance(ok, Admitted)
        no = await inner.admit(req(f"{TICKET}b", ts, 0))  # the 13th: only 3 would be
        assert isinstance(no, Refused) and no.limit == "headroom" and no.tier == "key"
        assert isinstance(await inner.admit(req("r12", ts, 0)), Admitted)  # a request may
        assert state(redis_url)[1].count(f"{TICKET}b".encode()) == 0  # it committed nothing
    finally:
        await inner.close()


async def test_a_ticket_the_sweep_claims_gets_no_event(redis_url: str) -> None:
    """A sidecar killed holding a ticket: its lease runs out, the sweep frees its slots and
    reservation, and reports no orphan (no request existed)."""
    ts = tiers()
    inner = RedisLimiter(RespClient(redis_url), lease_ttl=1, deadline=SLACK)
    try:
        assert isinstance(await inner.admit(req(f"{TICKET}x", ts)), Admitted)
        assert isinstance(await inner.admit(req("real", ts)), Admitted)
        orphans = await inner.sweep(time.time() + 5)
        assert [o.request_id for o in orphans] == ["real"]
        assert state(redis_url) == (0, [], [], [])
    finally:
        await inner.close()


async def test_a_lost_connection_fails_closed_whatever_tickets_are_held(tmp_path: Path) -> None:
    server = redis_service(free_port(), tmp_path).start()
    lim = AheadLimiter(RedisLimiter(RespClient(f"redis://{server.address}/0"), lease_ttl=60,
                                    deadline=SLACK),
                       ttl=10.0)
    try:
        ts = tiers()
        await lim.admit(req("r1", ts))
        await until(lambda: bool(lim._shelf))
        server.stop()
        await asyncio.sleep(0.05)  # the connection's end reaches the client
        with pytest.raises(StoreUnavailable):
            await lim.admit(req("r2", ts))
        assert not lim._shelf
    finally:
        await lim.close()
        server.stop()


async def test_a_live_request_id_takes_no_ticket(ahead: AheadLimiter) -> None:
    ts = tiers()
    await ahead.admit(req("r1", ts))
    await until(lambda: bool(ahead._shelf))
    ahead.follows = lambda rid: rid == "r1"
    before = taken()
    got = await ahead.admit(req("r1", ts))
    assert not isinstance(got, Admitted) and taken() == before  # Redis: DuplicateId


async def test_a_request_free_of_token_windows_asks_no_ticket(ahead: AheadLimiter) -> None:
    """A ticket admitted past the token windows (as count_tokens is) would let the next
    request of those tiers by them, whatever it reserves: none is made from one. One made
    from a request that counts them may serve one that does not (it passed more)."""
    ts = tiers()
    free = AdmitRequest("f1", ts, 0, time.time(), tokens=False)
    got = await ahead.admit(free)
    assert isinstance(got, Admitted) and got.owes_settlement  # its concurrency slots
    await asyncio.sleep(0.05)
    assert not ahead._shelf and not ahead._asking
    await ahead.admit(req("r1", ts))
    await until(lambda: bool(ahead._shelf))
    before = taken()
    assert isinstance(await ahead.admit(AdmitRequest("f2", ts, 0, time.time(), tokens=False)),
                      Admitted)
    assert taken() == before + 1
    await asyncio.sleep(0.05)
    assert not ahead._shelf and not ahead._asking  # f2 asked for none after it
