"""The billing database: dedup mark and aggregate in one transaction, SQLite and PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.billing.db import UsageDb, gaps

PG = "postgresql://postgres@127.0.0.1:5432/test"


def _pg_available() -> bool:
    try:
        import psycopg
        psycopg.connect(PG, connect_timeout=2).close()
        return True
    except Exception:
        return False


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UsageDb]:
    if request.param == "sqlite":
        d = UsageDb(f"sqlite:///{tmp_path / 'u.db'}")
        yield d
        d.close()
        return
    if not _pg_available():
        pytest.skip("no PostgreSQL on 127.0.0.1:5432 (the python-svc machines run one)")
    import psycopg
    schema = f"t_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    d = UsageDb(f"{PG}?options=-csearch_path%3D{schema}")
    yield d
    d.close()
    with psycopg.connect(PG, autocommit=True) as c:
        c.execute(f"DROP SCHEMA {schema} CASCADE")


def ev(i: int, team: str = "t", tokens: int = 10, inst: str = "i1", outcome: str = "completed",
       ended: str = "2026-11-29T10:00:00.000Z") -> usage_pb2.UsageEvent:
    return usage_pb2.UsageEvent(
        event_id=f"e{i}", instance_id=inst, seq=i, ended_at=ended,
        team=team, key_id="k", model="m", outcome=outcome, usage_source="reported",
        usage=usage_pb2.Usage(prompt_tokens=tokens, completion_tokens=1,
                              total_tokens=tokens + 1))


def test_duplicates_change_no_total(db: UsageDb) -> None:
    assert db.ingest([ev(1), ev(2), ev(3, team="u")]).new == 3
    got = db.ingest([ev(2), ev(3, team="u"), ev(4)])
    assert (got.new, got.duplicates) == (1, 2)
    assert db.by_outcome("team", "", "")[0] == [("t", 3, 0, 0, 0, 30, 3, 33),
                                                 ("u", 1, 0, 0, 0, 10, 1, 11)]
    assert db.duplicates() == {"i1": 2}
    assert db.seqs() == {"i1": [1, 2, 3, 4]}


def test_a_failed_batch_leaves_nothing_behind(db: UsageDb) -> None:
    db.ingest([ev(1)])
    with pytest.raises(AttributeError):  # the consumer dies mid-batch
        db.ingest([ev(5), ev(6), None])  # type: ignore[list-item]
    assert db.by_outcome("team", "", "")[0] == [("t", 1, 0, 0, 0, 10, 1, 11)]  # nor e5/e6's
    assert db.ingest([ev(5), ev(6)]).new == 2


def test_an_event_recorded_twice_leaves_no_false_gap(db: UsageDb, tmp_path: Path) -> None:
    """A request's record made durable just before its sidecar was killed is recorded
    again after the restart, under a new seq: billed once, and both seqs count as seen."""
    again = ev(3)
    again.seq = 4  # the same event_id, re-recorded after the restart
    got = db.ingest([ev(1), ev(2), ev(3), again, ev(5)])
    assert (got.new, got.duplicates) == (4, 1)
    assert db.seqs() == {"i1": [1, 2, 3, 4, 5]}
    assert gaps(db.seqs()["i1"]) == []


def test_a_database_from_before_seen_seqs_keeps_its_seqs(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    UsageDb(f"sqlite:///{path}").ingest([ev(1), ev(2)])
    with sqlite3.connect(path) as c:  # as an older version left it: no seen_seqs
        c.execute("DROP TABLE seen_seqs")
    assert UsageDb(f"sqlite:///{path}").seqs() == {"i1": [1, 2]}


def test_gaps() -> None:
    assert gaps([1, 2, 3]) == []
    assert gaps([2, 3, 7]) == [(1, 1), (4, 6)]
    assert gaps([]) == []


def test_report_splits_outcomes_bills_no_denial_and_keeps_to_its_period(db: UsageDb) -> None:
    from gateway.billing import report

    with pytest.raises(report.ReportError, match="holds no usage events"):
        report.report(db, "team")
    db.ingest([ev(1), ev(2, outcome="denied", tokens=0), ev(3, outcome="client_cancelled"),
               ev(4, outcome="upstream_error", tokens=0),
               ev(5, ended="2026-11-30T00:00:00.000Z")])
    rep = report.report(db, "team", report.day_bound("2026-11-29", "--since"),
                        report.day_bound("2026-11-30", "--until"))
    assert [(r.name, r.completed, r.client_cancelled, r.upstream_error, r.denied,
             r.total_tokens) for r in rep.rows] == [("t", 1, 1, 1, 1, 23)]  # not e2
    assert rep.first.startswith("2026-11-29") and rep.last.startswith("2026-11-29")
    everything = report.report(db, "team")
    assert everything.rows[0].completed == 2
    for fmt in ("table", "csv", "json"):
        assert "client_cancelled" in report.render(rep, fmt).lower()
    for bad in ("2026-13-01", "yesterday", "2026-11-30T10:00:00"):
        with pytest.raises(report.ReportError):
            report.day_bound(bad, "--since")
