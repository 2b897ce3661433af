"""The billing database: dedup mark and aggregate in one transaction, SQLite and PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.billing import report
from gateway.billing.db import Rejected, UsageDb, gaps, unfit
from gateway.sinks.gate import UsageGate

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
       ended: str = "2026-11-29T10:00:00.000Z", model: str = "m", cached: int = 0,
       cost: float = 0.0, endpoint: str = "/v1/chat/completions") -> usage_pb2.UsageEvent:
    return usage_pb2.UsageEvent(
        event_id=f"e{i}", instance_id=inst, seq=i, ended_at=ended, endpoint=endpoint,
        team=team, key_id="k", model=model, outcome=outcome, usage_source="reported",
        usage=usage_pb2.Usage(prompt_tokens=tokens, completion_tokens=1,
                              total_tokens=tokens + 1, cached_tokens=cached), cost=cost)


def totals(db: UsageDb) -> list[tuple[str, int, int]]:
    """(team, completed, total tokens) per team."""
    return [(r.name, r.completed, r.total_tokens) for r in report.report(db, "team").rows]


def test_duplicates_change_no_total(db: UsageDb) -> None:
    assert db.ingest([ev(1), ev(2), ev(3, team="u")]).new == 3
    got = db.ingest([ev(2), ev(3, team="u"), ev(4)])
    assert (got.new, got.duplicates) == (1, 2)
    assert totals(db) == [("t", 3, 33), ("u", 1, 11)]
    assert db.duplicates() == {"i1": 2}
    assert db.seqs() == {"i1": [1, 2, 3, 4]}


def test_a_failed_batch_leaves_nothing_behind(db: UsageDb) -> None:
    db.ingest([ev(1)])
    with pytest.raises(AttributeError):  # the consumer dies mid-batch
        db.ingest([ev(5), ev(6), None])  # type: ignore[list-item]
    assert totals(db) == [("t", 1, 11)]  # nor e5/e6's
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


def test_report_by_team_and_model_per_day_with_cached_tokens_and_cost(db: UsageDb) -> None:
    db.ingest([
        ev(1, model="a", cached=4, cost=0.25, ended="2026-11-29T10:00:00.000Z"),
        ev(2, model="a", cached=2, cost=0.5, ended="2026-11-29T23:59:59.999Z"),
        ev(3, model="b", cost=1.0, ended="2026-11-29T11:00:00.000Z"),
        ev(4, model="a", cost=2.0, ended="2026-11-30T00:00:00.000Z"),
        ev(5, team="u", model="a", cost=4.0, ended="2026-11-30T01:00:00.000Z"),
        ev(6, model="a", tokens=0, outcome="denied", ended="2026-11-30T02:00:00.000Z"),
    ])
    rep = report.report(db, "team,model", per="day")
    assert rep.columns == ("day", "team", "model")
    assert [(r.group, r.completed, r.denied, r.prompt_tokens, r.cached_tokens, r.cost)
            for r in rep.rows] == [
        (("2026-11-29", "t", "a"), 2, 0, 20, 6, 0.75),
        (("2026-11-29", "t", "b"), 1, 0, 10, 0, 1.0),
        (("2026-11-30", "t", "a"), 1, 1, 10, 0, 2.0),
        (("2026-11-30", "u", "a"), 1, 0, 10, 0, 4.0),
    ]
    month = report.report(db, "model", per="month")
    assert [(r.group, r.completed, r.cost) for r in month.rows] == [
        (("2026-11", "a"), 4, 6.75), (("2026-11", "b"), 1, 1.0)]
    csv = report.render(rep, "csv").splitlines()
    assert csv[0] == ("day,team,model,completed,client_cancelled,upstream_error,denied,"
                      "not_billed,prompt_tokens,cached_tokens,cache_creation_tokens,"
                      "completion_tokens,total_tokens,cost")
    assert csv[1] == "2026-11-29,t,a,2,0,0,0,0,20,6,0,2,22,0.750000"
    rows = orjson.loads(report.render(rep, "json"))["rows"]
    assert rows[0]["day"] == "2026-11-29" and rows[0]["model"] == "a" and rows[0]["cost"] == 0.75
    assert "2026-11-30  u" in report.render(rep, "table")
    for bad in ("team,team", "tenant", ""):
        with pytest.raises(report.ReportError, match="--by"):
            report.report(db, bad)


def test_read_only_requests_are_not_billed_requests(db: UsageDb) -> None:
    db.ingest([ev(1), ev(2, tokens=0, endpoint="/v1/models"),
               ev(3, tokens=0, endpoint="/v1/models/m"),
               ev(4, tokens=0, endpoint="/v1/messages/count_tokens")])
    (row,) = report.report(db, "team").rows
    assert (row.completed, row.not_billed) == (1, 3)


def test_a_database_from_before_cost_gets_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as c:  # the first version's events table, with one event
        c.execute(SCHEMA_V1)
        c.execute("INSERT INTO usage_events VALUES ('e0','i1',1,'2026-11-29T09:00:00.000Z',"
                  "'t','k','m','completed',5,1,6,'reported')")
    db = UsageDb(f"sqlite:///{path}")
    db.ingest([ev(1, cost=1.5, cached=3)])
    (row,) = report.report(db, "team").rows
    assert (row.completed, row.total_tokens, row.cached_tokens, row.cost) == (2, 17, 3, 1.5)


SCHEMA_V1 = """CREATE TABLE usage_events (
    event_id TEXT PRIMARY KEY, instance_id TEXT NOT NULL, seq BIGINT NOT NULL,
    ended_at TEXT NOT NULL, team TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
    outcome TEXT NOT NULL, prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL,
    total_tokens BIGINT NOT NULL, usage_source TEXT NOT NULL)"""


def test_a_price_change_mid_day_bills_the_morning_at_the_old_price(db: UsageDb) -> None:
    """The price table gains a new entry effective at noon: the day's report bills the
    morning's requests at the old price and the afternoon's at the new one, whichever
    revision the events were made under, and re-reading them changes nothing."""
    from datetime import datetime
    from typing import Any

    from gateway.metering.billing import Billed
    from gateway.metering.handoff import RequestFacts
    from gateway.metering.recorder import Recorder
    from gateway.policy.loader import load
    from gateway.sinks.usage_proto import from_json
    from gateway.usage_event import Usage

    before = load("""
models: {m: {prices: [{effective: 2026-01-01T00:00:00Z, input: 1, output: 2}]}}
""")
    after = load("""
models: {m: {prices: [{effective: 2026-01-01T00:00:00Z, input: 1, output: 2},
                      {effective: 2026-12-01T12:00:00Z, input: 10, output: 20}]}}
""")

    class Spool:
        instance_id = "i1"
        lines: list[bytes] = []
        gate = UsageGate()

        def next_seq(self) -> int:
            return len(self.lines) + 1

        def put(self, seq: int, line: bytes, on_durable: Any = None) -> None:
            self.lines.append(line)

    spool = Spool()

    def request(rid: str, at: str, revision: Any) -> None:
        start = datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
        rec = Recorder(spool, "s", None, price=revision.price)  # type: ignore[arg-type]
        facts = RequestFacts(request_id=rid, key_id="k", team="t", model="m",
                             endpoint="/v1/chat/completions")
        rec.emit(facts, Billed("completed", 200, Usage(1_000_000, 1_000_000, 2_000_000),
                               "reported", "m"), start, start + 30)

    request("morning-1", "2026-12-01T08:00:00Z", before)
    request("morning-2", "2026-12-01T11:59:50Z", after)  # made after the revision, ends at 12:00:20
    request("noon", "2026-12-01T12:00:00Z", after)
    request("evening", "2026-12-01T18:00:00Z", after)
    events = [from_json(line) for line in spool.lines]
    assert [e.cost for e in events] == [3.0, 3.0, 30.0, 30.0]
    db.ingest(events)
    db.ingest(events)  # redelivered: no change
    (day,) = report.report(db, "team,model", per="day").rows
    assert (day.group, day.completed, day.cost) == (("2026-12-01", "t", "m"), 4, 66.0)


def bad(offset: int, value: bytes = b"\xff not json", error: str = "ParseError: x"
        ) -> Rejected:
    return Rejected("llm.usage.v1", 0, offset, error, value)


def test_unreadable_records_are_quarantined_once_with_their_batch(db: UsageDb) -> None:
    got = db.ingest([ev(1), ev(2)], [bad(1), bad(3, b"")])
    assert (got.new, got.duplicates, got.rejected) == (2, 0, 2)
    got = db.ingest([ev(2)], [bad(1), bad(4, b"\x00\x01" * 1000)])  # re-delivered, and one new
    assert (got.new, got.duplicates, got.rejected) == (0, 1, 1)
    count, rows = db.rejected()
    assert count == 3
    assert [(r.offset, r.value) for r in rows] == [
        (1, b"\xff not json"), (3, b""), (4, b"\x00\x01" * 1000)]  # whole, bytes as they were
    assert db.rejected(limit=1) == (3, rows[:1])
    with pytest.raises(AttributeError):  # the batch fails: its quarantine goes with it
        db.ingest([ev(5), None], [bad(9)])  # type: ignore[list-item]
    assert db.rejected()[0] == 3
    assert totals(db) == [("t", 2, 22)]


def test_what_ingest_cannot_take_is_unfit() -> None:
    assert unfit(ev(1)) == ""
    no_id, no_inst, no_end, nan = ev(1), ev(1), ev(1), ev(1)
    no_id.event_id = ""
    no_inst.instance_id = ""
    no_end.ended_at = ""
    nan.cost = float("nan")
    assert "event_id" in unfit(no_id)
    assert "instance_id" in unfit(no_inst)
    assert "ended_at" in unfit(no_end)
    assert "cost" in unfit(nan)
    assert "seq" in unfit(ev(0)) and "seq" in unfit(ev(2**63))  # 0: none; 2**63: no BIGINT
    for text in ("yesterday", "2026-12-06", "2026-12-06T21:00:00", "2026-12-06T21:00:00-05:00"):
        other = ev(1)
        other.ended_at = text  # no day in UTC to bill it to (the first 10 characters are)
        assert "ended_at" in unfit(other), text
    for text in ("2026-12-06T21:00:00.123Z", "2026-12-06t21:00:00z", "2026-12-06T21:00:00+00:00"):
        other = ev(1)
        other.ended_at = text
        assert unfit(other) == "", text
    negative = ev(1)
    negative.usage.completion_tokens = -5  # would take tokens off the team's totals
    assert "negative" in unfit(negative)
    assert unfit(ev(2**63 - 1)) == ""
    for outcome in ("", "timeout", "Completed"):  # the report would count its request nowhere
        assert "outcome" in unfit(ev(1, outcome=outcome)), outcome
    for outcome in ("completed", "client_cancelled", "upstream_error", "denied"):
        assert unfit(ev(1, outcome=outcome)) == "", outcome


def test_an_event_billed_to_no_one_is_unfit() -> None:
    """A served request's event with no team (or no key_id) was billed to team "". A denied
    one legitimately has neither (an unknown key), and so may an upstream_error: the orphan
    sweep's, for an admission whose stored who-and-what it cannot read."""
    for outcome in ("completed", "client_cancelled"):
        no_team, no_key = ev(1, team="", outcome=outcome), ev(1, outcome=outcome)
        no_key.key_id = ""
        assert unfit(no_team) == f"a {outcome} event with no team: it would be billed to no one"
        assert unfit(no_key) == f"a {outcome} event with no key_id: it would be billed to no one"
    for outcome in ("denied", "upstream_error"):
        nobody = ev(1, team="", outcome=outcome)
        nobody.key_id = ""
        assert unfit(nobody) == "", outcome


def test_reconcile_lists_quarantined_records_and_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main
    url = f"sqlite:///{tmp_path / 'u.db'}"
    spools = ["--spool-dir", str(tmp_path)]
    UsageDb(url).ingest([], [bad(7, error="no event_id (the dedup key)")])  # nothing else
    assert main(["usage", "reconcile", "--db", url, *spools]) == 1  # not 2: it read something
    out = capsys.readouterr().out
    assert "UNREADABLE: 1 record(s)" in out
    assert "llm.usage.v1 partition 0 offset 7: no event_id" in out
    UsageDb(url).ingest([ev(1)])
    assert main(["usage", "reconcile", "--db", url, *spools]) == 1  # no gap, still one
    clean = f"sqlite:///{tmp_path / 'clean.db'}"
    UsageDb(clean).ingest([ev(1)])
    capsys.readouterr()
    assert main(["usage", "reconcile", "--db", clean, *spools]) == 0
    assert "UNREADABLE" not in capsys.readouterr().out


def test_partitions_read_are_marked_once_their_offsets_are_committed(
        db: UsageDb, tmp_path: Path) -> None:
    tps = [("llm.usage.v1", 0), ("llm.usage.v1", 1)]
    assert db.unread(tps) == tps
    db.ingest([ev(1)])  # in the database, offsets not yet committed: still unread
    assert db.unread(tps) == tps
    db.mark_read([tps[1], tps[1]])
    assert db.unread(tps) == [tps[0]]
    db.mark_read(tps)
    assert db.unread(tps) == []
    again = UsageDb(db.url)  # reopened: a database with events and no marks is not old
    db.ingest([ev(2)])
    assert again.unread([("llm.usage.v1", 5)]) == [("llm.usage.v1", 5)]
    again.close()
    again = UsageDb(db.url)
    assert again.unread([("llm.usage.v1", 5)]) == [("llm.usage.v1", 5)]
    again.close()
    import sqlite3

    old = tmp_path / "old.db"  # filled before marks: every partition was read
    UsageDb(f"sqlite:///{old}").ingest([ev(1)])
    with sqlite3.connect(old) as c:
        c.execute("DROP TABLE read_partitions")
    assert UsageDb(f"sqlite:///{old}").unread(tps) == []


def test_two_consumers_on_one_postgresql_database_neither_deadlock_nor_race(
        db: UsageDb) -> None:
    """Two consumers of one group (different partitions) ingest at once: each batch touches
    the same (day, team, key, model) totals in its own order, and two opening a new
    database at once both create its tables. Neither may fail (PostgreSQL once answered
    DeadlockDetected, and UniqueViolation on CREATE TABLE IF NOT EXISTS)."""
    import threading

    if isinstance(db.conn, __import__("sqlite3").Connection):
        pytest.skip("SQLite serializes writers (BEGIN IMMEDIATE)")
    schema = f"t_{uuid.uuid4().hex[:8]}"
    import psycopg
    with psycopg.connect(PG, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    url = f"{PG}?options=-csearch_path%3D{schema}"
    errors: list[str] = []
    opened: list[UsageDb] = []
    start = threading.Barrier(4)

    def worker(w: int) -> None:
        try:
            start.wait()
            d = UsageDb(url)
            opened.append(d)
            teams = [f"t{j}" for j in range(20)][:: 1 if w % 2 else -1]
            for b in range(30):
                base = w * 100_000 + b * 100
                d.ingest([ev(base + j, team=teams[j % 20]) for j in range(1, 101)])
        except Exception as exc:
            errors.append(repr(exc)[:300])

    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        (row,) = report.report(opened[0], "key").rows
        assert row.completed == 4 * 30 * 100
    finally:
        for d in opened:
            d.close()
        with psycopg.connect(PG, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")


COSTS = [0.1, 0.2, 0.000000001, 0.000000003, 1234.567891234, 0.7, 1e-9, 0.3]


def test_the_reported_cost_is_the_exact_sum_of_the_events_costs(db: UsageDb) -> None:
    """Costs are rounded to 1e-9 in each event; the report's sum is theirs exactly (no
    binary-float drift such as 0.1 + 0.2 = 0.30000000000000004), on either database, and
    the same across outcome rows folded into one."""
    from decimal import Decimal

    outcomes = ["completed", "client_cancelled", "upstream_error"]
    db.ingest([ev(i + 1, cost=c, outcome=outcomes[i % 3]) for i, c in enumerate(COSTS)])
    (row,) = report.report(db, "team").rows
    exact = sum(Decimal(repr(c)) for c in COSTS)
    assert row.cost == float(exact)
    assert orjson.loads(report.render(report.report(db, "team"), "json"))["rows"][0][
        "cost"] == float(exact)
    db.ingest([ev(20, cost=0.1, team="u"), ev(21, cost=0.2, team="u")])
    assert [r.cost for r in report.report(db, "team").rows] == [float(exact), 0.3]


def test_an_ended_at_in_any_accepted_utc_form_is_billed_to_its_instant(db: UsageDb) -> None:
    """`ended_at` in UTC but not as the gateway writes it (milliseconds, "Z"): +00:00,
    lowercase, no fraction, more digits, ISO basic. Each lands in its own UTC day and on its
    side of --since (inclusive) and --until (exclusive), as the instant it names."""
    forms = {  # ended_at -> in [21:00:00.000, 23:00:00.500) on 2026-12-06?
        "2026-12-06T21:00:00+00:00": True,  # exactly --since
        "2026-12-06t20:00:00z": False,
        "2026-12-06T23:00:00Z": True,  # before 23:00:00.500
        "2026-12-06T23:00:00.4999999Z": True,
        "2026-12-06T23:00:00.500+00:00": False,  # exactly --until
        "20261206T220000Z": True,
    }
    db.ingest([ev(i + 1, ended=t, team=f"t{i}") for i, t in enumerate(forms)])
    since = report.day_bound("2026-12-06T21:00:00Z", "--since")
    until = report.day_bound("2026-12-06T23:00:00.500Z", "--until")
    inside = {r.name for r in report.report(db, "team", since, until).rows}
    assert inside == {f"t{i}" for i, ok in enumerate(forms.values()) if ok}
    days = {r.group[0] for r in report.report(db, "team", per="day").rows}
    assert days == {"2026-12-06"}


def test_the_operators_time_zone_and_its_dst_change_shift_nothing(
        db: UsageDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """US clocks go back on 2026-11-01 (New York): the report's days, months and bounds are
    UTC whatever the operator's zone."""
    import time

    events = [ev(1, ended="2026-11-01T04:59:59.999Z"), ev(2, ended="2026-11-01T05:00:00.000Z"),
              ev(3, ended="2026-11-01T23:30:00.000Z"), ev(4, ended="2026-11-02T00:00:00.000Z"),
              ev(5, ended="2026-10-31T23:59:59.999Z")]
    db.ingest(events)

    def view() -> tuple[object, ...]:
        s, u = report.day_bound("2026-11-01", "--since"), report.day_bound("2026-11-02",
                                                                           "--until")
        return (s, u, [(r.group, r.completed) for r in report.report(db, "team", s, u,
                                                                       per="day").rows],
                [(r.group, r.completed) for r in report.report(db, "team", per="month").rows])

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    in_utc = view()
    assert in_utc[2] == [(("2026-11-01", "t"), 3)]
    for zone in ("America/New_York", "Australia/Lord_Howe", "Pacific/Kiritimati"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        assert view() == in_utc, zone
    monkeypatch.undo()
    time.tzset()


def test_sqlite_and_postgresql_give_the_same_report_for_the_same_events(
        tmp_path: Path) -> None:
    if not _pg_available():
        pytest.skip("no PostgreSQL on 127.0.0.1:5432")
    import random

    import psycopg

    rnd = random.Random(7)
    teams, models = ["alpha", "Beta", "_c", "ß", "a b"], ["m-1", "M2", "m_3"]
    outcomes = ["completed", "client_cancelled", "upstream_error", "denied"]
    endpoints = ["/v1/chat/completions", "/v1/models", "/v1/messages/count_tokens"]
    events = []
    for i in range(1, 601):
        e = ev(i, team=rnd.choice(teams), tokens=rnd.randint(0, 2**40), model=rnd.choice(models),
               outcome=rnd.choice(outcomes), cost=round(rnd.random() * 3, 9),
               cached=rnd.randint(0, 10), endpoint=rnd.choice(endpoints),
               ended=f"2026-{rnd.randint(10, 12)}-{rnd.randint(10, 28)}T{rnd.randint(0, 23):02}"
                     f":{rnd.randint(0, 59):02}:00.{rnd.randint(0, 999):03}Z")
        e.key_id = rnd.choice(["k1", "K2"])
        events.append(e)
    events += events[:50]  # redelivered
    schema = f"t_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    lite, pg = UsageDb(f"sqlite:///{tmp_path / 'u.db'}"), UsageDb(
        f"{PG}?options=-csearch_path%3D{schema}")
    try:
        for d in (lite, pg):
            for at in range(0, len(events), 97):
                d.ingest(events[at:at + 97])
        for by, per, since, until in [("team", "", "", ""), ("key,model", "day", "", ""),
                                      ("model,team,key", "month", "2026-11-01", "2026-12-15")]:
            s, u = report.day_bound(since, "--since"), report.day_bound(until, "--until")
            for fmt in ("json", "csv", "table"):
                assert report.render(report.report(lite, by, s, u, per), fmt) == \
                    report.render(report.report(pg, by, s, u, per), fmt), (by, per, fmt)
            # and the totals are the sum of the distinct events in the period
            inside = [e for e in {e.event_id: e for e in events}.values()
                      if (not s or e.ended_at >= s) and (not u or e.ended_at < u)]
            billed = [e for e in inside if e.outcome != "denied"]
            rows = report.report(lite, by, s, u, per).rows
            assert sum(r.total_tokens for r in rows) == sum(e.usage.total_tokens for e in billed)
            assert sum(r.denied for r in rows) == len(inside) - len(billed)
            assert sum(r.completed + r.client_cancelled + r.upstream_error + r.not_billed
                       for r in rows) == len(billed)
            assert round(sum(r.cost for r in rows), 6) == round(sum(e.cost for e in billed), 6)
    finally:
        lite.close()
        pg.close()
        with psycopg.connect(PG, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {schema} CASCADE")
