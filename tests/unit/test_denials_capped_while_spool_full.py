"""A full spool disk: new requests are refused (503), and each refusal's denial event waits
in memory with the billed events of requests admitted before. Past DENIED_HELD_MAX events
held, a denial's event is counted and dropped instead, so a client retrying without end
cannot exhaust memory (an OOM kill would lose the billed events too). A real Spool; its
writer is not run, so nothing reaches the disk, as on a full one."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway import log, metrics
from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.metering import recorder as recorder_module
from gateway.metering.billing import settle
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.metering.recorder import Recorder
from gateway.sinks.spool import Spool


def _denial(rid: str) -> RequestFacts:
    return RequestFacts(request_id=rid, key_id="k", team="t", model="m",
                        endpoint="/v1/chat/completions", stream=False, denied_status=503)


def _served(rid: str) -> RequestFacts:
    return RequestFacts(request_id=rid, key_id="k", team="t", model="m",
                        endpoint="/v1/chat/completions", stream=False)


def _emit(rec: Recorder, facts: RequestFacts) -> int:
    response = ResponseFacts(status=facts.denied_status or 200, ended=True)
    return rec.emit(facts, settle(facts, response), 0.0, 0.0).seq


def _dropped() -> float:
    return metrics.DENIALS_DROPPED._value.get()


def test_denials_past_the_cap_are_dropped_and_billed_events_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log.configure("info", cache=False)
    monkeypatch.setattr(recorder_module, "DENIED_HELD_MAX", 3)
    spool = Spool(tmp_path, "i1").open()
    rec = Recorder(spool, "s", Ledger(MemoryLimiter(), SystemClock(), 30.0))
    before = _dropped()

    assert [_emit(rec, _denial(f"open{i}")) for i in range(4)] == [1, 2, 3, 4]  # open: kept
    spool.gate.set(True, "No space left on device")
    assert spool.in_memory == 4  # at the cap already: the next denials go
    assert [_emit(rec, _denial(f"full{i}")) for i in range(3)] == [0, 0, 0]
    assert _dropped() - before == 3
    assert _emit(rec, _served("billed")) == 5  # a billed event is never dropped
    assert spool.in_memory == 5
    kept = [orjson.loads(line)["event_id"] for line in spool._queue]
    assert kept == ["open0", "open1", "open2", "open3", "billed"]
    err = capsys.readouterr().err
    assert err.count("usage_denials_dropped") == 1  # once an outage, not once a request

    spool.gate.set(False)  # the disk came back: denials kept again
    assert _emit(rec, _denial("after")) == 6
    spool.gate.set(True, "No space left on device")  # a second outage is logged again
    assert _emit(rec, _denial("again")) == 0
    assert capsys.readouterr().err.count("usage_denials_dropped") == 1
    spool.close()


def test_under_the_cap_a_full_spool_keeps_every_denial(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "i1").open()
    rec = Recorder(spool, "s", Ledger(MemoryLimiter(), SystemClock(), 30.0))
    spool.gate.set(True, "No space left on device")
    before = _dropped()
    assert [_emit(rec, _denial(f"d{i}")) for i in range(50)] == list(range(1, 51))
    assert _dropped() == before
    spool.close()
