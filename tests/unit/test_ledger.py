"""The ledger of admissions: every transition, idempotence, refusals, give-ups, adoption,
batching and retries, over the real in-memory limiter (its loops run on real time, the
admissions' clock is a FakeClock)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from prometheus_client import REGISTRY

from gateway.clock import FakeClock
from gateway.errors import StoreUnavailable
from gateway.limits.ledger import RENEW_CHUNK, Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.limits.stages import FROM, Stage
from gateway.limits.types import (
    Abandon,
    AdmitRequest,
    Admitted,
    Ending,
    Orphan,
    Release,
    Settle,
    Void,
)
from gateway.log import configure
from gateway.policy.model import LimitSpec, TierLimit

SLOT = TierLimit("key", "k", LimitSpec(concurrency=1, tokens_per_day=10_000))
WIDE = TierLimit("key", "wide", LimitSpec(concurrency=1_000, tokens_per_day=10**9))
TTL = 0.15  # the renew loop's tick is then 0.05 s


@dataclass
class Store(MemoryLimiter):
    """The in-memory limiter, recording each batch of endings; `down` refuses them."""

    batches: list[list[Ending]] = field(default_factory=list)
    renewals: list[tuple[float, list[str]]] = field(default_factory=list)  # (now, ids)
    down: bool = False

    async def renew(self, request_ids: list[str], now: float,
                    checkpoints: Mapping[str, tuple[int, int]] | None = None) -> list[str]:
        self.renewals.append((now, list(request_ids)))
        return await super().renew(request_ids, now, checkpoints)

    async def end_many(self, ends: Sequence[Ending]) -> None:
        if self.down:
            raise StoreUnavailable("redis: connection refused")
        self.batches.append(list(ends))
        await super().end_many(ends)

    def ended(self) -> list[Ending]:
        return [e for batch in self.batches for e in batch]


async def admit(lim: MemoryLimiter, rid: str, now: float, reserve: int = 100,
                tier: TierLimit = SLOT) -> None:
    v = await lim.admit(AdmitRequest(rid, (tier,), reserve, now))
    assert isinstance(v, Admitted) and v.owes_settlement


async def ticks(n: int = 3) -> None:
    await asyncio.sleep(0.06 * n)


def refusals(transition: str, stage: str) -> float:
    return REGISTRY.get_sample_value(
        "gateway_ledger_refused_total", {"transition": transition, "stage": stage}) or 0.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def lim() -> Store:
    return Store(lease_ttl=TTL)


def ledger_of(lim: Store, clock: FakeClock, watches: bool = False,
              max_lifetime_s: float = float("inf")) -> Ledger:
    ledger = Ledger(lim, clock, lease_ttl=TTL, watches=watches, unheard_s=1.0,
                    max_lifetime_s=max_lifetime_s)
    ledger.start()
    return ledger


# --- the usual lives ----------------------------------------------------------------------


async def test_a_streamed_admission_is_released_at_once_then_settled(
        lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    try:
        await admit(lim, "r", clock.now())
        ledger.admitted("r")
        assert ledger.stage("r") is Stage.ADMITTED
        ledger.begun("r", lambda: (3, 4))
        assert ledger.stage("r") is Stage.BEGUN
        await ticks()
        assert lim.held["r"].checkpoint == (3, 4)  # renewed, with its usage so far
        ledger.released("r")
        assert ledger.stage("r") is Stage.RELEASED
        await ticks(1)
        assert lim.in_flight("key", "k", clock.now()) == 0  # its slot is free at once ...
        assert "r" in lim.held  # ... its reservation waits for the durable event
        ledger.settled("r", 7)
        assert ledger.stage("r") is Stage.SETTLED
        await ticks(1)
        assert "r" not in lim.held
        assert lim.ended() == [Release("r"), Settle("r", 7)]
    finally:
        await ledger.stop()


async def test_an_envoy_fed_admission_is_renewed_from_the_check_until_its_end(
        lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock, watches=True)
    try:
        await admit(lim, "r", clock.now())
        ledger.admitted("r")
        clock.advance(0.5)
        await ticks()
        assert await lim.sweep(clock.now()) == []  # renewed though nothing began here
        ledger.released("r")
        ledger.settled("r", 9)
        await ticks(1)
        assert lim.ended() == [Release("r"), Settle("r", 9)] and "r" not in lim.held
    finally:
        await ledger.stop()


async def test_an_admission_another_process_follows_is_freed_by_its_settlement(
        lim: Store, clock: FakeClock) -> None:
    """Its record reached this worker, the Check another: no early release of slots this
    process does not renew; the settlement, moments later, frees everything."""
    ledger = ledger_of(lim, clock)
    try:
        await admit(lim, "theirs", clock.now())
        ledger.released("theirs")
        assert ledger.stage("theirs") is Stage.RELEASED
        ledger.settled("theirs", 1)
        await ticks(1)
        assert lim.ended() == [Settle("theirs", 1)] and "theirs" not in lim.held
    finally:
        await ledger.stop()


async def test_a_void_releases_and_charges_nothing(lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    try:
        await admit(lim, "late", clock.now(), reserve=500)
        ledger.admitted("late")
        ledger.voided("late")
        assert ledger.stage("late") is Stage.VOIDED
        await ticks(1)
        assert lim.ended() == [Void("late")] and "late" not in lim.held
        await admit(lim, "next", clock.now(), reserve=10_000)  # all 10,000 tokens are back
    finally:
        await ledger.stop()


async def test_an_orphaned_admission_goes_to_the_sweep_at_once(
        lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    try:
        await admit(lim, "lost", clock.now())
        ledger.begun("lost", lambda: (10, 20))
        await ticks()
        ledger.orphaned("lost")  # its record was unreadable
        assert ledger.stage("lost") is Stage.ORPHANED
        await ticks(1)
        [orphan] = await ledger.sweep(clock.now(), 100)  # no need to wait for its lease
        assert (orphan.request_id, orphan.charged) == ("lost", 30)
        assert lim.ended() == [Abandon("lost")]
    finally:
        await ledger.stop()


async def test_an_orphan_whose_record_is_gone_is_logged_and_counted_not_billed(
        lim: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The store claimed an id whose record had expired: no event can be made, so the
    ledger says so (an error line, a counter) and hands the recorder nothing for it."""
    configure("info", cache=False)
    ledger = ledger_of(lim, clock)

    async def store_sweep(now: float, limit: int = 100) -> list[Orphan]:
        return [Orphan("gone", "", 0, None, lost=True), Orphan("kept", "[]", 3)]

    monkeypatch.setattr(lim, "sweep", store_sweep)
    before = REGISTRY.get_sample_value("gateway_orphan_records_lost_total") or 0
    try:
        assert [o.request_id for o in await ledger.sweep(clock.now(), 100)] == ["kept"]
        assert REGISTRY.get_sample_value("gateway_orphan_records_lost_total") == before + 1
        err = capsys.readouterr().err
        assert "orphan_record_lost" in err and "gone" in err
    finally:
        await ledger.stop()


async def test_endings_that_come_together_go_in_one_store_call(
        lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    try:
        for i in range(5):
            ledger.settled(f"r{i}", i)
        await ticks(1)
        assert lim.batches == [[Settle(f"r{i}", i) for i in range(5)]]
    finally:
        await ledger.stop()


async def test_endings_are_retried_while_the_store_is_down(lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    try:
        await admit(lim, "r", clock.now())
        lim.down = True
        ledger.settled("r", 3)
        await ticks(2)
        assert "r" in lim.held  # not yet: the store refuses
        lim.down = False
        await asyncio.sleep(0.6)  # the backoff is at most 0.5 s
        assert lim.ended() == [Settle("r", 3)] and "r" not in lim.held
    finally:
        await ledger.stop()


async def test_stop_flushes_what_is_pending(lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    ledger.settled("r", 1)
    await ledger.stop()
    assert lim.ended() == [Settle("r", 1)]


# --- idempotence and refusals -------------------------------------------------------------


async def test_a_repeated_transition_changes_nothing(lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    try:
        ledger.admitted("r")
        ledger.admitted("r")
        ledger.begun("r")
        ledger.begun("r")
        assert ledger.stage("r") is Stage.BEGUN
        ledger.released("r")  # a cut stream: released when the cut is seen ...
        ledger.released("r")  # ... and again with its event
        ledger.settled("r", 5)
        ledger.settled("r", 5)
        ledger.voided("v")
        ledger.voided("v")
        ledger.orphaned("o")
        ledger.orphaned("o")
        await ticks(1)
        assert lim.ended() == [Release("r"), Settle("r", 5), Void("v"), Abandon("o")]
        assert refusals("settled", "settled") == 0 and refusals("released", "released") == 0
    finally:
        await ledger.stop()


@pytest.mark.parametrize(("first", "then", "stage"), [
    ("voided", "settled", "voided"),  # the sweep or nobody bills a voided admission
    ("orphaned", "settled", "orphaned"),  # the sweep bills it: one event
    ("settled", "released", "settled"),
    ("settled", "orphaned", "settled"),
    ("voided", "orphaned", "voided"),
    ("released", "begun", "released"),
    ("released", "heard", "released"),  # a heartbeat after the end (a retried batch)
])
async def test_a_transition_from_a_stage_it_cannot_come_from_is_a_counted_no_op(
        lim: Store, clock: FakeClock, first: str, then: str, stage: str) -> None:
    ledger = ledger_of(lim, clock)
    calls = {"admitted": lambda r: ledger.admitted(r), "begun": lambda r: ledger.begun(r),
             "heard": lambda r: ledger.heard(r, None), "released": ledger.released,
             "settled": lambda r: ledger.settled(r, 1), "voided": ledger.voided,
             "orphaned": ledger.orphaned}
    try:
        before = refusals(then, stage)
        ledger.begun("r")
        calls[first]("r")
        await ticks(1)
        sent = lim.ended()
        calls[then]("r")  # never raises
        await ticks(1)
        assert ledger.stage("r") is Stage(stage)
        assert lim.ended() == sent  # nothing sent for it
        assert refusals(then, stage) == before + 1
    finally:
        await ledger.stop()


async def test_every_transition_refuses_an_empty_request_id(
        lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock)
    try:
        before = {t: refusals(t, "no_id") for t in FROM}
        ledger.admitted("")
        ledger.begun("")
        ledger.heard("", (1, 1))
        ledger.released("")
        ledger.settled("", 3)
        ledger.voided("")
        ledger.orphaned("")
        await ticks(1)
        assert ledger.stage("") is None and lim.ended() == []
        assert all(refusals(t, "no_id") == before[t] + 1 for t in FROM)
    finally:
        await ledger.stop()


async def test_a_void_of_an_id_settled_before_is_still_sent(
        lim: Store, clock: FakeClock) -> None:
    """A client reused the id, and its new admission's answer came too late: whatever the
    store commits for it must be undone."""
    ledger = ledger_of(lim, clock)
    try:
        ledger.settled("reused", 4)
        ledger.voided("reused")
        await ticks(1)
        assert lim.ended() == [Settle("reused", 4), Void("reused")]
        ledger.admitted("reused")  # and a later admission of it starts a new life
        assert ledger.stage("reused") is Stage.ADMITTED
    finally:
        await ledger.stop()


# --- given up: unheard, expired -----------------------------------------------------------


async def test_a_watched_admission_nobody_reports_is_given_up_and_swept(
        lim: Store, clock: FakeClock) -> None:
    """Envoy died (or lost the record): no heartbeat, so the lease is no longer renewed, it
    runs out, and the sweep frees the slot and bills the request."""
    ledger = ledger_of(lim, clock, watches=True)
    try:
        await admit(lim, "lost", clock.now())
        ledger.admitted("lost")
        clock.advance(0.9)
        await ticks()
        assert ledger.stage("lost") is Stage.ADMITTED  # within unheard_s: still renewed
        assert await lim.sweep(clock.now()) == []
        clock.advance(0.2)  # past unheard_s without a word from Envoy
        await ticks()
        assert ledger.stage("lost") is Stage.UNHEARD
        clock.advance(0.2)  # its last lease runs out
        [orphan] = await ledger.sweep(clock.now(), 100)
        assert orphan.request_id == "lost" and ledger.stage("lost") is Stage.ORPHANED
    finally:
        await ledger.stop()


async def test_heartbeats_keep_a_long_request_alive_with_its_usage_so_far(
        lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock, watches=True)
    try:
        await admit(lim, "long", clock.now())
        ledger.admitted("long")
        for used in (10, 20, 30):  # a 2.4 s stream, heard every 0.8 s
            clock.advance(0.8)
            ledger.heard("long", (5, used))
            await ticks()
            assert ledger.stage("long") is Stage.ADMITTED
        clock.advance(1.1)  # then silence: the sweep bills the last checkpoint
        await ticks()
        clock.advance(0.2)
        [orphan] = await lim.sweep(clock.now())
        assert (orphan.checkpoint, orphan.charged) == ((5, 30), 35)
    finally:
        await ledger.stop()


async def test_a_heartbeat_takes_back_an_admission_given_up_as_unheard(
        lim: Store, clock: FakeClock) -> None:
    """The records' way was cut for a while: once Envoy speaks of it again, it is renewed
    again (and its end, with the real usage, settles it) unless the sweep got it first."""
    ledger = ledger_of(lim, clock, watches=True)
    try:
        await admit(lim, "quiet", clock.now())
        ledger.admitted("quiet")
        clock.advance(1.1)
        await ticks()
        assert ledger.stage("quiet") is Stage.UNHEARD
        ledger.heard("quiet", (2, 3))
        assert ledger.stage("quiet") is Stage.ADMITTED
        await ticks()
        assert lim.held["quiet"].checkpoint == (2, 3)  # renewed again
    finally:
        await ledger.stop()


async def test_a_heartbeat_adopts_an_admission_another_instance_made(
        lim: Store, clock: FakeClock) -> None:
    """Admitted by a worker that since restarted (or another worker): whoever hears the
    heartbeat renews it; its end settles it there."""
    ledger = ledger_of(lim, clock)
    try:
        await admit(lim, "adopted", clock.now())
        ledger.heard("adopted", None)
        assert ledger.stage("adopted") is Stage.ADMITTED
        clock.advance(0.5)
        await ticks()
        assert await lim.sweep(clock.now()) == []  # renewed from here
        ledger.settled("adopted", 7)
        await ticks()
        assert "adopted" not in lim.held
    finally:
        await ledger.stop()


async def test_no_stream_is_renewed_past_the_maximum_lifetime(
        lim: Store, clock: FakeClock) -> None:
    """A stream that never ends gives its slot back: not renewed past the bound, its lease
    runs out and the sweep bills its last checkpoint. Its end, if it comes, still settles."""
    ledger = ledger_of(lim, clock, max_lifetime_s=1.0)
    try:
        await admit(lim, "endless", clock.now())
        ledger.begun("endless", lambda: (5, 40))
        clock.advance(0.9)
        await ticks()
        assert ledger.stage("endless") is Stage.BEGUN
        assert await lim.sweep(clock.now()) == []
        clock.advance(0.2)
        await ticks()
        assert ledger.stage("endless") is Stage.EXPIRED
        clock.advance(0.2)  # its last lease runs out
        [orphan] = await ledger.sweep(clock.now(), 100)
        assert (orphan.checkpoint, orphan.charged) == ((5, 40), 45)
        assert ledger.stage("endless") is Stage.ORPHANED
    finally:
        await ledger.stop()


async def test_heartbeats_do_not_renew_an_admission_past_its_lifetime(
        lim: Store, clock: FakeClock) -> None:
    ledger = ledger_of(lim, clock, watches=True, max_lifetime_s=1.0)
    try:
        await admit(lim, "stuck", clock.now())
        ledger.admitted("stuck")
        for _ in range(3):
            clock.advance(0.5)
            ledger.heard("stuck", (1, 1))
            await ticks()
        assert ledger.stage("stuck") is Stage.EXPIRED  # heard of, but never renewed again
        clock.advance(0.2)
        [orphan] = await lim.sweep(clock.now())
        assert orphan.request_id == "stuck"
        ledger.settled("stuck", 2)  # its end came after all: nothing left to settle
        await ticks(1)
        assert ledger.stage("stuck") is Stage.SETTLED
    finally:
        await ledger.stop()


async def test_an_admission_whose_stream_never_begins_here_is_forgotten(
        lim: Store, clock: FakeClock) -> None:
    """ext_proc source: the stream begins in whichever worker Envoy picks, or never (the
    client left): this worker does not renew it, and forgets it after the first lease."""
    ledger = ledger_of(lim, clock)
    try:
        await admit(lim, "elsewhere", clock.now())
        ledger.admitted("elsewhere")
        await ticks()
        assert ledger.stage("elsewhere") is Stage.ADMITTED
        assert lim.held["elsewhere"].until == clock.now() + TTL  # never renewed here
        clock.advance(TTL)
        await ticks()
        assert ledger.stage("elsewhere") is None
        ledger.begun("other")  # and a stream another worker admitted is taken on here
        assert ledger.stage("other") is Stage.BEGUN
    finally:
        await ledger.stop()


# --- what a tick costs: only what it renews -----------------------------------------------
# These drive the renewal loop's body (_wakeup) by hand, one tick of the fake clock at a
# time, with the default TTLs (lease 30 s, start 5 s): a round of everyone every 6th tick.


def stepped(lim: Store, clock: FakeClock, **kw: float | bool) -> Ledger:
    return Ledger(lim, clock, lease_ttl=lim.lease_ttl, start_ttl=lim.start_ttl,
                  **kw)  # type: ignore[arg-type]


async def step(ledger: Ledger, clock: FakeClock) -> None:
    clock.advance(ledger.tick)
    await ledger._wakeup()


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.fixture
def slow_lim() -> Store:
    return Store(lease_ttl=30.0, start_ttl=5.0)


async def test_a_tick_between_rounds_renews_only_the_fresh_admissions(
        slow_lim: Store, clock: FakeClock) -> None:
    ledger = stepped(slow_lim, clock)
    old = [f"r{i}" for i in range(50)]
    for rid in old:
        await admit(slow_lim, rid, clock.now(), tier=WIDE)
        ledger.begun(rid)
    await step(ledger, clock)
    assert slow_lim.renewals == [(clock.now(), old)]  # fresh: within a third of the start TTL
    last_round = clock.now() - ledger.tick  # the loop's start: none fresh before it
    slow_lim.renewals.clear()
    await admit(slow_lim, "new", clock.now(), tier=WIDE)
    ledger.begun("new")
    while not slow_lim.renewals or slow_lim.renewals[-1][1] == ["new"]:
        await step(ledger, clock)
    *between, (at, everyone) = slow_lim.renewals
    assert [ids for _, ids in between] == [["new"]]  # once, and nobody else
    assert sorted(everyone) == sorted([*old, "new"])  # then the round of everyone, in time
    assert at - last_round <= ledger.renew_every + ledger.tick / 2


async def test_the_open_gauge_follows_each_transition_without_waiting_for_a_tick(
        slow_lim: Store, clock: FakeClock) -> None:
    """A drain waits for gateway_admissions_open to reach 0: it must not lag behind the
    last end (the ledger's loop is not even running here)."""
    ledger = stepped(slow_lim, clock)
    ledger.admitted("a")  # not renewed here until its stream begins
    assert sample("gateway_admissions_open") == 0
    ledger.begun("a")
    ledger.begun("b")
    assert sample("gateway_admissions_open") == 2
    ledger.released("a")
    assert sample("gateway_admissions_open") == 1
    ledger.settled("b", 1)
    assert sample("gateway_admissions_open") == 0
    watched = stepped(slow_lim, clock, watches=True)
    watched.admitted("w")
    watched.heard("theirs", None)  # adopted
    assert sample("gateway_admissions_open") == 2
    watched.voided("w")
    watched.orphaned("theirs")
    assert sample("gateway_admissions_open") == 0


@pytest.mark.parametrize(("watches", "bound", "stage", "counter"), [
    (True, "unheard_s", Stage.UNHEARD, "gateway_admissions_unheard_total"),
    (False, "max_lifetime_s", Stage.EXPIRED, "gateway_admissions_expired_total"),
])
async def test_given_up_by_the_next_round_and_never_renewed_past_its_bound(
        slow_lim: Store, clock: FakeClock, watches: bool, bound: str, stage: Stage,
        counter: str) -> None:
    """Between rounds only the fresh are renewed, so what passes its bound then is given
    up at the next round of everyone (before it is renewed): its lease history, and so when
    the sweep frees it, is what it was when every tick looked at every admission."""
    ledger = stepped(slow_lim, clock, watches=watches, **{bound: 20.0})
    await admit(slow_lim, "r", clock.now())
    if watches:
        ledger.admitted("r")
    else:
        ledger.begun("r")
    deadline = clock.now() + 20.0
    before = sample(counter)
    for _ in range(100):
        await step(ledger, clock)
        if ledger.stage("r") is not (Stage.ADMITTED if watches else Stage.BEGUN):
            break
    assert ledger.stage("r") is stage and sample(counter) == before + 1
    assert deadline < clock.now() <= deadline + ledger.renew_every + ledger.tick
    renewed_at = [at for at, ids in slow_lim.renewals if "r" in ids]
    assert renewed_at and max(renewed_at) <= deadline
    assert slow_lim.held["r"].until <= deadline + slow_lim.lease_ttl  # then the sweep's


async def test_a_process_envoy_never_reports_to_gives_up_unheard_without_an_alarm(
        slow_lim: Store, clock: FakeClock) -> None:
    """A door process (hears=False) renews its admissions until another process hears of
    them; letting one go then is no loss of Envoy's: given up alike, neither counted nor
    logged as unheard."""
    ledger = stepped(slow_lim, clock, watches=True, unheard_s=20.0, hears=False)
    deadline = clock.now() + 20.0
    await admit(slow_lim, "r", clock.now())
    ledger.admitted("r")
    before = sample("gateway_admissions_unheard_total")
    for _ in range(100):
        await step(ledger, clock)
        if ledger.stage("r") is not Stage.ADMITTED:
            break
    assert ledger.stage("r") is Stage.UNHEARD
    assert sample("gateway_admissions_unheard_total") == before
    assert max(at for at, ids in slow_lim.renewals if "r" in ids) <= deadline


@pytest.mark.parametrize("bound", ["unheard_s", "max_lifetime_s"])
async def test_a_fresh_admission_past_its_bound_is_not_renewed_between_rounds(
        slow_lim: Store, clock: FakeClock, bound: str) -> None:
    ledger = stepped(slow_lim, clock, watches=True, **{bound: 1.0})  # shorter than a tick
    await admit(slow_lim, "r", clock.now())
    ledger.admitted("r")
    await step(ledger, clock)  # not a round of everyone: the fresh ones are looked at too
    assert slow_lim.renewals == []
    assert ledger.stage("r") is (Stage.UNHEARD if bound == "unheard_s" else Stage.EXPIRED)


async def test_renewals_go_a_chunk_at_a_time_and_the_loop_runs_between(
        slow_lim: Store, clock: FakeClock) -> None:
    """Reading every stream's checkpoint at once would hold every Check: a chunk at a time,
    and what ends between two chunks is not renewed after its end."""
    ledger = stepped(slow_lim, clock)
    rids = [f"r{i}" for i in range(2 * RENEW_CHUNK + 1)]
    for rid in rids:
        await admit(slow_lim, rid, clock.now(), tier=WIDE)
        ledger.begun(rid)
    asyncio.get_running_loop().call_soon(ledger.released, rids[-1])  # at the first yield
    await step(ledger, clock)
    assert [ids for _, ids in slow_lim.renewals] == [rids[:RENEW_CHUNK],
                                                     rids[RENEW_CHUNK:-1]]
