"""Usage delivery under faults: Kafka down, the sidecar killed, events delivered twice."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer

from gateway.billing.db import UsageDb
from gateway.cli import main as gateway
from gateway.settings import DEFAULT_METERING, METERING_SOURCES
from testkit.spoke import client, read_events, start_spoke

MSG = [{"role": "user", "content": "hello there"}]


def _requests(spoke, key: str, n: int) -> set[str]:  # type: ignore[no-untyped-def]
    c = client(spoke, key)
    ids = set()
    for i in range(n):
        if i % 2:
            raw = c.chat.completions.with_raw_response.create(
                model="mock-model", messages=MSG, max_tokens=3, stream=True)
            list(raw.parse())
        else:
            raw = c.chat.completions.with_raw_response.create(
                model="mock-model", messages=MSG, max_tokens=3)
        assert raw.status_code == 200  # the client never waits for Kafka
        ids.add(raw.headers["x-request-id"])
    return ids


def _spool_depth(spoke) -> float:  # type: ignore[no-untyped-def]
    return _metric(spoke, "gateway_usage_spool_depth")


def _metric(spoke, name: str) -> float:  # type: ignore[no-untyped-def]
    text = httpx.get(f"{spoke.metrics_url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith(name))
    return float(line.split()[-1])


def test_kafka_stopped_then_restarted_loses_nothing(tmp_path: Path) -> None:
    """Spool to Kafka is the same path for both metering sources: one proves it."""
    metering = DEFAULT_METERING
    spoke, keys = start_spoke(tmp_path / "spoke", metering=metering,
                              sidecar_env={"GATEWAY_SPOOL_ALERT_S": "1"})
    try:
        spoke["kafka"].stop()
        t0 = time.monotonic()
        ids = _requests(spoke, keys["good"], 20)
        assert time.monotonic() - t0 < 10  # responses did not wait on the dead broker
        deadline = time.monotonic() + 5
        while _spool_depth(spoke) < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _spool_depth(spoke) >= 20  # held in the spool, visible in /metrics
        # ... and loud once it has waited past the threshold: a gauge to alert on, a log
        deadline = time.monotonic() + 10
        while _metric(spoke, "gateway_usage_spool_oldest_age_seconds") < 1.5 and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(spoke, "gateway_usage_spool_oldest_age_seconds") >= 1.5
        assert '"usage_delivery_stalled"' in spoke["sidecar"].log_path.read_text()
        spoke["kafka"].restart()  # memory storage: a fresh, empty broker
        events = read_events(spoke.kafka_bootstrap, ids, timeout=30)
        assert {e["event_id"] for e in events} == ids
        assert len(events) == len(ids)
        seqs = sorted(int(e["seq"]) for e in events)
        assert seqs == list(range(seqs[0], seqs[0] + 20))  # in order, no gap
        deadline = time.monotonic() + 5
        while _metric(spoke, "gateway_usage_spool_oldest_age_seconds") and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(spoke, "gateway_usage_spool_oldest_age_seconds") == 0  # cleared
        assert '"usage_delivery_recovered"' in spoke["sidecar"].log_path.read_text()
    finally:
        spoke.stop()


@pytest.mark.parametrize("metering", METERING_SOURCES)
def test_sidecar_killed_spool_survives_and_reconciles(tmp_path: Path, metering: str
                                                      ) -> None:
    spoke, keys = start_spoke(tmp_path / "spoke", metering=metering)
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    try:
        before = _requests(spoke, keys["good"], 5)
        read_events(spoke.kafka_bootstrap, before)
        spoke["kafka"].pause()  # Kafka unreachable: what follows stays in the spool
        during = _requests(spoke, keys["good"], 10)
        time.sleep(0.3)  # past the group commit: on disk
        spoke["sidecar"].kill()  # SIGKILL: no shutdown, no flush
        spoke["kafka"].resume()
        spoke["sidecar"].restart()  # same spool dir: the instance and its seq continue
        events = read_events(spoke.kafka_bootstrap, before | during, timeout=30)
        assert {e["event_id"] for e in events} == before | during
        assert len({e["instance_id"] for e in events}) == 1
        total = len(before | during)
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--count", str(total)]) == 0
        assert gateway(["usage", "reconcile", "--db", db,
                        "--spool-dir", str(spoke.workdir / "spool")]) == 0  # no gaps
    finally:
        spoke.stop()


def test_events_delivered_twice_are_counted_once(tmp_path: Path,  # type: ignore[no-untyped-def]
                                                capsys) -> None:
    """The consumer's dedup does not depend on the metering source: one proves it."""
    metering = DEFAULT_METERING
    spoke, keys = start_spoke(tmp_path / "spoke", metering=metering)
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    try:
        ids = _requests(spoke, keys["good"], 6)
        events = read_events(spoke.kafka_bootstrap, ids)
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--count", "6"]) == 0
        capsys.readouterr()
        assert gateway(["usage", "report", "--db", db, "--by", "key", "-o", "json"]) == 0
        first = json.loads(capsys.readouterr().out)["rows"][0]

        async def redeliver() -> None:  # what a producer retry after a lost ack would do
            import orjson
            p = AIOKafkaProducer(bootstrap_servers=spoke.kafka_bootstrap, acks="all")
            await p.start()
            for e in events:
                await p.send_and_wait("llm.usage.v1", orjson.dumps(e),
                                      key=e["event_id"].encode())
            await p.stop()

        asyncio.run(redeliver())
        n = _requests(spoke, keys["good"], 1)  # one genuinely new event after the duplicates
        read_events(spoke.kafka_bootstrap, n)
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--count", "1"]) == 0
        capsys.readouterr()
        assert gateway(["usage", "report", "--db", db, "--by", "key", "-o", "json"]) == 0
        second = json.loads(capsys.readouterr().out)["rows"][0]
        assert second["completed"] == first["completed"] + 1  # the 6 duplicates: nothing
        assert second["total_tokens"] > first["total_tokens"]
        gateway(["usage", "reconcile", "--db", db, "--spool-dir", str(spoke.workdir / "spool")])
        out = capsys.readouterr().out
        assert " 6 " in out.splitlines()[1]  # six duplicates seen and dropped
    finally:
        spoke.stop()


def test_billing_commands_through_the_cli(spoke, keys, tmp_path: Path,  # type: ignore[no-untyped-def]
                                          capsys) -> None:
    """What the billing team runs from cron: consume until caught up, then a report split by
    outcome; on a database nothing filled, report and reconcile say so instead of printing
    an empty table."""
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    assert gateway(["usage", "report", "--db", empty]) == 2
    assert gateway(["usage", "reconcile", "--db", empty, "--spool-dir", str(tmp_path)]) == 2
    assert "usage consume" in capsys.readouterr().err
    assert gateway(["usage", "report", "--db", empty, "--since", "30/11/2026"]) == 2
    ids = _requests(spoke, keys["good"], 3)
    read_events(spoke.kafka_bootstrap, ids)
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    t0 = time.monotonic()
    assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                    "--until-caught-up"]) == 0
    assert time.monotonic() - t0 < 30  # it stopped by itself
    capsys.readouterr()
    assert gateway(["usage", "report", "--db", db, "--by", "key", "-o", "json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["good"]["completed"] >= 3  # (its denials, from other tests, apart)
    assert gateway(["usage", "tail", "--kafka", spoke.kafka_bootstrap]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert ids <= {e["event_id"] for e in events}
    order = [(e["ended_at"], e["instance_id"], int(e["seq"])) for e in events]
    assert order == sorted(order)  # in time order


def test_a_new_database_reads_the_topic_from_its_start_whatever_the_group_committed(
        spoke, keys, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The consumer group's offsets live in Kafka, not in the database: `usage consume`
    into a second database (another directory's `usage.db`, a new billing host) with the
    group the first one committed used to start where the first stopped, so its report
    missed every earlier event and `reconcile` showed them as gaps. A database never filled
    reads from the start; once it holds events the group's offsets rule again."""
    group = f"g-{tmp_path.name}"
    ids = _requests(spoke, keys["good"], 3)
    read_events(spoke.kafka_bootstrap, ids)
    first, second = (f"sqlite:///{tmp_path / n}" for n in ("first.db", "second.db"))
    for db in (first, second):
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--group", group, "--until-caught-up"]) == 0
    capsys.readouterr()
    rows = []
    for db in (first, second):
        assert gateway(["usage", "report", "--db", db, "--by", "key", "-o", "json"]) == 0
        rows.append(json.loads(capsys.readouterr().out)["rows"])
    assert rows[0] == rows[1] and any(r["name"] == "good" for r in rows[1])
    later = _requests(spoke, keys["good"], 1)  # the second now follows the group's offsets
    read_events(spoke.kafka_bootstrap, later)
    assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", second,
                    "--group", group, "--until-caught-up"]) == 0
    db = UsageDb(second)
    try:  # nothing read twice: it went on from the group's offsets, not from the start
        assert not any(db.duplicates().values())
    finally:
        db.close()
