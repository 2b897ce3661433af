"""A sidecar killed between an event's fsync and its settlement's flush left the admission
holding its reservation: at the next start its spool's tail is read back (Spool.tail) and
the events of its last moments settled again (recorder.settlements, Ledger.settled_before).
`gateway serve` doing it against a real Redis: tests/integration/test_serve.py."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.limits.types import AdmitRequest, Admitted
from gateway.metering.recorder import settlements
from gateway.policy.model import LimitSpec, TierLimit
from gateway.sinks import spool as spool_module
from gateway.sinks.spool import Spool
from gateway.usage_event import Usage, UsageEvent, event_json, rfc3339


def event(rid: str, seq: int, total: int, outcome: str = "completed",
          ended: float | None = None) -> bytes:
    at = rfc3339(time.time() if ended is None else ended)
    return event_json(UsageEvent(
        event_id=rid, spoke="s", instance_id="i", seq=seq, started_at=at, ended_at=at,
        key_id="k", team="t", model="m", served_model="m", endpoint="/v1/chat/completions",
        stream=False, status_code=200, outcome=outcome,
        usage=Usage(prompt_tokens=total - 1, completion_tokens=1, total_tokens=total),
        usage_source="reported", ttft_ms=1.0, tpot_ms=0.0, duration_ms=1.0))


def test_settlements_are_the_events_own_rule() -> None:
    now = time.time()
    lines = [event("a", 1, 12), event("denied", 2, 0, outcome="denied"),
             b"not json", b'{"event_id": "no usage"}', event("old", 3, 7, ended=now - 600),
             event("b", 4, 30, outcome="client_cancelled")]
    assert list(settlements(lines, since=now - 60)) == [("a", 12), ("b", 30)]


async def test_the_tail_of_a_spool_is_what_its_last_run_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_module, "TAIL_MAX", 3)
    sp = Spool(tmp_path, "i").open()
    assert sp.tail == []
    for _ in range(5):
        seq = sp.next_seq()
        sp.put(seq, event(f"r{seq}", seq, seq))
    await sp.commit()
    sp.close()
    again = Spool(tmp_path, "i").open()
    try:
        assert [orjson.loads(x)["event_id"] for x in again.tail] == ["r3", "r4", "r5"]
        assert abs(again.tail_written_at - time.time()) < 60
    finally:
        again.close()


async def test_a_previous_runs_settlement_reaches_the_store_once_and_is_not_followed() -> None:
    store = MemoryLimiter()
    tier = TierLimit("key", "k", LimitSpec(concurrency=1, tokens_per_day=1000))
    first = await store.admit(AdmitRequest("r1", (tier,), 100, time.time()))
    assert isinstance(first, Admitted) and first.owes_settlement
    ledger = Ledger(store, SystemClock(), 30.0)
    ledger.start()
    try:
        assert ledger.settled_before([("r1", 12), ("gone", 5)]) == 2
        assert await ledger.outbox.sent(2)
        assert ledger.stage("r1") is None  # sent as it is: nothing follows it here
        # The slot is free again and the day's counter holds the 12 billed, not the 100.
        second = await store.admit(AdmitRequest("r2", (tier,), 0, time.time()))
        assert isinstance(second, Admitted)
        assert second.rate.tok_remaining == 1000 - 12
    finally:
        await ledger.stop()

