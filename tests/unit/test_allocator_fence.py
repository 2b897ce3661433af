"""The allocators' fence (gateway/hub/fence.py): which of several may publish allowances,
decided from the heartbeats read so far; pure, so the clock is an argument."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import orjson
import pytest

from gateway.hub import quota_topic as qt
from gateway.hub.allocator import Allocator, _Rebuild
from gateway.hub.fence import Fence, Heartbeat, heartbeat_key, parse_heartbeat_key
from gateway.log import configure
from gateway.usage_event import rfc3339

IV = 5.0


def hb(aid: str, started: float, active: bool = False, interval_s: float = IV
       ) -> dict[str, object]:
    return Heartbeat(aid, started, interval_s, active).message(None, 0)


def me(started: float = 100.0, active: bool = True) -> Fence:
    f = Fence(Heartbeat("me", started, IV, active))
    f.wrote(0.0)
    return f


def test_a_heartbeat_key_is_neither_an_allowance_nor_a_report_for_any_spoke() -> None:
    key = heartbeat_key("host-1-abc123")
    assert qt.parse_key(key) is None  # this version's and the previous allocator's reading
    assert parse_heartbeat_key(key) == "host-1-abc123"
    for spoke in ("allocator", "heartbeat", "east"):  # a follower takes only its own key
        assert key != qt.allowance_key(spoke) and key != qt.applied_key(spoke)
        assert parse_heartbeat_key(qt.allowance_key(spoke)) is None
        assert parse_heartbeat_key(qt.applied_key(spoke)) is None


def test_alone_it_publishes_once_its_own_heartbeat_is_written() -> None:
    f = Fence(Heartbeat("me", 100.0, IV, True))
    assert f.leads(0.0) and not f.may_publish(0.0)  # no heartbeat written yet
    f.wrote(0.0)
    assert f.may_publish(1.0)


def test_it_stops_itself_when_its_heartbeats_stop_before_the_others_count_it_gone() -> None:
    f = me()
    assert f.may_publish(2 * IV - 0.1)
    assert not f.may_publish(2 * IV)  # the others wait 3 intervals: one to spare


def test_a_newer_live_allocator_leads_and_an_older_one_does_not() -> None:
    f = me(started=100.0)
    f.on_heartbeat("old", hb("old", 50.0), 0.0)
    assert f.leads(0.0)
    f.on_heartbeat("new", hb("new", 200.0), 0.0)
    assert not f.leads(0.0) and f.leader(0.0).id == "new"
    assert not f.may_publish(0.0)


def test_a_silent_leader_is_gone_after_three_of_its_own_intervals() -> None:
    f = me(started=100.0)
    f.on_heartbeat("new", hb("new", 200.0, active=True, interval_s=2.0), 10.0)
    f.wrote(15.0)
    assert f.leader(16.0).id == "new"  # within 3 x 2 s of its last heartbeat
    assert f.leader(16.1).id == "me" and f.may_publish(16.1)


def test_leading_it_waits_until_an_older_claimant_withdraws() -> None:
    f = me(started=100.0)
    f.on_heartbeat("old", hb("old", 50.0, active=True), 0.0)
    assert f.leads(0.0) and not f.may_publish(0.0)
    assert [h.id for h in f.claimants(0.0)] == ["old"]
    f.on_heartbeat("old", hb("old", 50.0, active=False), 1.0)  # read ours: withdrew
    assert f.may_publish(1.0)


def test_an_older_claimant_that_never_withdraws_is_waited_out() -> None:
    f = me(started=100.0)
    f.on_heartbeat("old", hb("old", 50.0, active=True), 0.0)
    f.wrote(14.0)
    assert not f.may_publish(15.0)
    assert f.may_publish(15.1)


def test_a_tombstone_is_an_allocator_that_stopped_at_once() -> None:
    f = me(started=100.0)
    f.on_heartbeat("new", hb("new", 200.0, active=True), 0.0)
    assert not f.leads(0.0)
    f.on_heartbeat("new", None, 0.5)
    assert f.may_publish(0.5)


def test_every_allocator_ranks_the_same_one_first_even_when_both_started_alike() -> None:
    a, b = Fence(Heartbeat("a", 100.0, IV, False)), Fence(Heartbeat("b", 100.0, IV, False))
    a.on_heartbeat("b", b.me.message(None, 0), 0.0)
    b.on_heartbeat("a", a.me.message(None, 0), 0.0)
    assert a.leader(0.0).id == b.leader(0.0).id == "b"


def test_an_unreadable_heartbeat_and_its_own_are_not_counted() -> None:
    f = me(started=100.0)
    f.on_heartbeat("me", hb("me", 900.0, active=True), 0.0)  # read back: not another
    f.on_heartbeat("x", {"started": "soon"}, 0.0)
    f.on_heartbeat("y", hb("y", 900.0, interval_s=0.0), 0.0)
    assert f.live(0.0) == [] and f.may_publish(0.0)


def _record(spoke: str, generation: int, writer: str | None) -> SimpleNamespace:
    msg = {"kind": "allowance", "spoke": spoke, "generation": generation, "allowances": [],
           **({"allocator": writer} if writer else {})}
    return SimpleNamespace(topic=qt.QUOTA_TOPIC, key=qt.allowance_key(spoke),
                           value=orjson.dumps(msg))


def test_an_allowance_another_wrote_while_this_one_publishes_is_logged_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    configure("info", cache=False)
    alloc = Allocator("127.0.0.1:1", IV, allocator_id="me")
    alloc.fold(_record("east", 1, "old"))  # a standby reads the active one's: normal
    assert "quota_allocator_foreign_allowance" not in capsys.readouterr().err
    alloc.ready = True
    alloc.fold(_record("east", 2, "me"))
    alloc.fold(_record("east", 3, None))  # no `allocator`: a version before the fence
    alloc.fold(_record("west", 4, None))
    err = capsys.readouterr().err
    assert err.count("quota_allocator_foreign_allowance") == 1, err
    assert "version without the fence" in err
    assert alloc.ledger.generation == 4  # folded all the same: one sequence


def test_withdrawing_with_allowances_not_sent_reads_the_ledger_again() -> None:
    alloc = Allocator("127.0.0.1:1", IV, allocator_id="me")
    newer = Heartbeat("new", 200.0, IV, True)
    alloc._withdraw(newer)  # nothing held back: it keeps its ledger
    alloc._unsent["east"] = {"generation": 1}
    with pytest.raises(_Rebuild):
        alloc._withdraw(newer)  # its ledger counts them issued: never sent, so read again
    assert alloc._unsent == {} and not alloc.ready


class _Pub:
    async def publish(self, key: bytes, msg: dict[str, object]) -> None:
        self.last = (key, msg)


def test_a_standby_forgets_past_days_as_the_active_one_does() -> None:
    """A standby never allocates (where the ledger forgets): months of usage event ids
    would pile up in it."""
    alloc = Allocator("127.0.0.1:1", IV, allocator_id="me")
    alloc.fence.on_heartbeat("new", hb("new", time.time() + 100, active=True),
                             time.monotonic())
    event = {"event_id": "e1", "spoke": "east", "team": "g", "key_id": "k1",
             "usage": {"total_tokens": "5"}, "started_at": rfc3339(time.time() - 3 * 86400)}
    alloc.fold(SimpleNamespace(topic=qt.USAGE_TOPIC, key=b"east", value=orjson.dumps(event)))
    assert alloc.ledger._seen
    pub = _Pub()
    asyncio.run(alloc._decide(None, pub, 0.0))  # type: ignore[arg-type]
    assert pub.last[1]["state"] == "standby" and pub.last[1]["leader"] == "new"
    assert not alloc.ledger._seen


def test_an_allocator_that_stalled_while_sending_sends_no_more_once_its_lease_is_out() -> None:
    """The fence is checked once per batch, before `_send`; `_send` then awaited Kafka for
    each spoke's message in turn. One stalled between them (a process paused, a Kafka that
    answered late) past its lease sent the rest on waking, when the others may already
    count it gone and a newer one publish: each message is sent only while the lease
    holds."""
    alloc = Allocator("127.0.0.1:1", IV, allocator_id="me")
    alloc._claim(True)
    alloc.fence.wrote(time.monotonic())
    alloc.ready = True
    alloc._unsent = {s: {"generation": g, "allowances": []}
                     for g, s in enumerate(["east", "west"], 1)}
    sent: list[bytes] = []

    class Stalls:
        async def publish(self, key: bytes, msg: dict[str, object]) -> None:
            sent.append(key)
            alloc.fence.wrote(time.monotonic() - 3 * IV)  # the send took three intervals

    asyncio.run(alloc._send(Stalls()))  # type: ignore[arg-type]
    assert sent == [b"east"]
    assert list(alloc._unsent) == ["west"]  # kept: sent once it may publish again
