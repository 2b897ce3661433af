"""Usage delivery under faults: Kafka down, the sidecar killed, events delivered twice.
(Billing's commands on a live spoke's topic: test_usage_consume_cli.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from usage_traffic import SESSION, send_requests

from gateway.cli import main as gateway
from gateway.settings import DEFAULT_METERING, METERING_SOURCES
from testkit.spoke import read_events, start_spoke


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
        ids = send_requests(spoke, keys["good"], 20)
        assert time.monotonic() - t0 < 10  # responses did not wait on the dead broker
        deadline = time.monotonic() + 15  # a wait, not a bound: load is no failure
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
        deadline = time.monotonic() + 15  # a wait, not a bound: load is no failure
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
        before = send_requests(spoke, keys["good"], 5)
        read_events(spoke.kafka_bootstrap, before)
        spoke["kafka"].pause()  # Kafka unreachable: what follows stays in the spool
        during = send_requests(spoke, keys["good"], 10)
        time.sleep(0.3)  # past the group commit: on disk
        spoke["sidecar"].kill()  # SIGKILL: no shutdown, no flush
        spoke["kafka"].resume()
        spoke["sidecar"].restart()  # same spool dir: the instance and its seq continue
        events = read_events(spoke.kafka_bootstrap, before | during, timeout=30)
        assert {e["event_id"] for e in events} == before | during
        assert len({e["instance_id"] for e in events}) == 1
        total = len(before | during)
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--count", str(total), *SESSION]) == 0
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
        ids = send_requests(spoke, keys["good"], 6)
        events = read_events(spoke.kafka_bootstrap, ids)
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--count", "6", *SESSION]) == 0
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
        n = send_requests(spoke, keys["good"], 1)  # one genuinely new event after the duplicates
        read_events(spoke.kafka_bootstrap, n)
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--count", "1", *SESSION]) == 0
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
