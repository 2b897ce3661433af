"""Billing's commands on a live spoke's topic: `usage consume` (as cron runs it, and into a
new database on a group another one committed), report, tail. (Delivery under faults:
test_delivery.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

from usage_traffic import SESSION, send_requests

from gateway.billing.db import UsageDb
from gateway.cli import main as gateway
from testkit.spoke import read_events


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
    ids = send_requests(spoke, keys["good"], 3)
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
    ids = send_requests(spoke, keys["good"], 3)
    read_events(spoke.kafka_bootstrap, ids)
    first, second = (f"sqlite:///{tmp_path / n}" for n in ("first.db", "second.db"))
    for db in (first, second):
        assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                        "--group", group, "--until-caught-up", *SESSION]) == 0
    capsys.readouterr()
    rows = []
    for db in (first, second):
        assert gateway(["usage", "report", "--db", db, "--by", "key", "-o", "json"]) == 0
        rows.append(json.loads(capsys.readouterr().out)["rows"])
    assert rows[0] == rows[1] and any(r["name"] == "good" for r in rows[1])
    later = send_requests(spoke, keys["good"], 1)  # the second now follows the group's offsets
    read_events(spoke.kafka_bootstrap, later)
    assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", second,
                    "--group", group, "--until-caught-up", *SESSION]) == 0
    db = UsageDb(second)
    try:  # nothing read twice: it went on from the group's offsets, not from the start
        assert not any(db.duplicates().values())
    finally:
        db.close()
