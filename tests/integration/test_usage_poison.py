"""`gateway usage consume` on a real Tansu past records it cannot read: each is quarantined
once, the good events around it are billed, the offsets move on, and `reconcile` says so.
Such a record used to stop the consumer before its offset commit, on every restart."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from devspoke.procs import Service, free_port, tansu_service
from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.billing.db import UsageDb
from gateway.cli import main as gateway
from gateway.sinks.usage_proto import proto_json


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path_factory.mktemp("tansu")).start()
    yield svc
    svc.stop()


def good(seq: int) -> bytes:
    return proto_json(usage_pb2.UsageEvent(
        event_id=f"e{seq}", instance_id="i1", seq=seq, ended_at="2026-12-01T10:00:00.000Z",
        team="t", key_id="k", model="m", outcome="completed", usage_source="reported",
        usage=usage_pb2.Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12)))


def past_int64(seq: int) -> bytes:
    """An event whose count no int64 holds (the metering sources once shipped 10**19)."""
    e = orjson.loads(good(seq))
    e["usage"]["prompt_tokens"] = "10000000000000000000"
    return orjson.dumps(e)


def nan_cost(seq: int) -> bytes:
    """Parses, but SQLite stores NaN as NULL: the batch's insert failed on NOT NULL."""
    e = orjson.loads(good(seq))
    e["cost"] = "NaN"
    return orjson.dumps(e)


GARBAGE = b"not json " + b"x" * 100_000  # large: the log keeps only a prefix
# offset: value (one partition, so the offsets are these)
TOPIC = [good(1), GARBAGE, good(2), b'{"hello": "world"}', past_int64(3), good(4),
         nan_cost(5), b"[1, 2]", b"\xff\xfe binary", good(6)]
BAD = {1: "Failed to load JSON", 3: "no event_id", 4: "prompt_tokens", 6: "cost nan",
       7: "ParseError", 8: "utf-8"}


async def put(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await p.start()
    try:
        for v in values:
            await p.send(topic, value=v, partition=0)
        await p.flush()
    finally:
        await p.stop()


def consume(tansu: Service, db: str, group: str) -> int:
    return gateway(["usage", "consume", "--kafka", tansu.address, "--db", db, "--group", group,
                    "--until-caught-up", "--session-timeout-s", "2"])  # Tansu joins in 1 s


def state(url: str) -> tuple[int, int, dict[int, str]]:
    """(events, duplicates dropped, quarantined offset -> error)."""
    db = UsageDb(url)
    try:
        n, rejected = db.rejected()
        assert n == len(rejected)
        assert all(r.topic == "usage.poison" and r.partition == 0 for r in rejected)
        assert {r.offset: r.value for r in rejected} == {o: TOPIC[o] for o in BAD}  # whole
        events = sum(len(s) for s in db.seqs().values())
        return events, sum(db.duplicates().values()), {r.offset: r.error for r in rejected}
    finally:
        db.close()


def test_unreadable_records_are_quarantined_once_and_billing_goes_on(
        tansu: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_USAGE_TOPIC", "usage.poison")
    asyncio.run(put(tansu.address, "usage.poison", TOPIC))
    first, second = (f"sqlite:///{tmp_path / n}" for n in ("first.db", "second.db"))

    assert consume(tansu, first, "g1") == 0  # it finished: caught up
    events, dups, errors = state(first)
    assert (events, dups) == (4, 0)
    assert sorted(errors) == sorted(BAD)
    for offset, word in BAD.items():
        assert word.lower() in errors[offset].lower(), errors[offset]
    err = capsys.readouterr().err
    assert err.count("usage_record_unreadable") == len(BAD)
    assert len(err) < 20_000  # a prefix of the 100 kB value, never all of it

    # Read again from the start (a new group): the events are duplicates, each bad record
    # is still quarantined once; and a new database (the first group's offsets at the end)
    # reads the topic from its start and quarantines them too.
    assert consume(tansu, first, "g2") == 0
    assert state(first) == (4, 4, errors)
    assert consume(tansu, second, "g1") == 0
    assert state(second) == (4, 0, errors)

    # The consumer's offsets moved past them: a later good event is read, nothing else.
    asyncio.run(put(tansu.address, "usage.poison", [good(7)]))
    assert consume(tansu, first, "g1") == 0
    assert state(first) == (5, 4, errors)

    capsys.readouterr()
    assert gateway(["usage", "reconcile", "--db", first, "--spool-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "UNREADABLE: 6 record(s)" in out
    assert "usage.poison partition 0 offset 1: " in out and "offset 7: " in out
    assert "offset 8: " not in out  # the first few; the table holds them all
    assert gateway(["usage", "report", "--db", first]) == 0
    assert "6 unreadable record(s)" in capsys.readouterr().err
