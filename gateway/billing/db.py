"""Exactly-once aggregation: an event's dedup mark and its aggregate change commit together.

SQLite (default, stdlib) or PostgreSQL (psycopg). The consumer commits Kafka offsets only
after this transaction, so a crash in between re-delivers events that the dedup marks then
drop: at-least-once delivery, exactly-once totals. A record the consumer cannot read is
quarantined in the same transaction (`rejected_records`, keyed by its topic position), so
it neither stalls the consumer nor vanishes.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway._proto.gateway.usage.v1 import usage_pb2

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS usage_events (
        event_id TEXT PRIMARY KEY, instance_id TEXT NOT NULL, seq BIGINT NOT NULL,
        ended_at TEXT NOT NULL, team TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
        outcome TEXT NOT NULL, prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL,
        total_tokens BIGINT NOT NULL, usage_source TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS usage_events_instance ON usage_events (instance_id, seq)",
    """CREATE TABLE IF NOT EXISTS usage_totals (
        day TEXT NOT NULL, team TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
        requests BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL, total_tokens BIGINT NOT NULL,
        PRIMARY KEY (day, team, key_id, model))""",
    """CREATE TABLE IF NOT EXISTS ingest_stats (
        instance_id TEXT PRIMARY KEY, duplicates BIGINT NOT NULL)""",
    # Every (instance, seq) received, duplicates of an event_id included: the gap check's
    # input. A request's event recorded twice (its record made durable just before its
    # sidecar was killed, sent again by Envoy after the restart) has two seqs; dropping
    # the second with the event would show a gap that is not one.
    """CREATE TABLE IF NOT EXISTS seen_seqs (
        instance_id TEXT NOT NULL, seq BIGINT NOT NULL, PRIMARY KEY (instance_id, seq))""",
    # Records `usage consume` could not read, by their place in the topic (re-delivered: one
    # row). The value is kept whole, as hex text: the same on SQLite and PostgreSQL.
    """CREATE TABLE IF NOT EXISTS rejected_records (
        topic TEXT NOT NULL, kafka_partition BIGINT NOT NULL, kafka_offset BIGINT NOT NULL,
        error TEXT NOT NULL, value_hex TEXT NOT NULL,
        PRIMARY KEY (topic, kafka_partition, kafka_offset))""",
    # The partitions `usage consume` has read into this database from their start and
    # committed the group's offsets for: one it has not is read from its start, whatever
    # offsets the group committed (for another database). Marked after the offset commit.
    """CREATE TABLE IF NOT EXISTS read_partitions (
        topic TEXT NOT NULL, kafka_partition BIGINT NOT NULL,
        PRIMARY KEY (topic, kafka_partition))""",
]

# Columns added since the first version: an older database gets them (zeros, "") on open.
ADDED = [("endpoint", "TEXT NOT NULL DEFAULT ''"),
         ("cached_tokens", "BIGINT NOT NULL DEFAULT 0"),
         ("cache_creation_tokens", "BIGINT NOT NULL DEFAULT 0"),
         ("reasoning_tokens", "BIGINT NOT NULL DEFAULT 0"),
         ("cost", "DOUBLE PRECISION NOT NULL DEFAULT 0")]
_COLUMNS = ("event_id, instance_id, seq, ended_at, team, key_id, model, outcome, prompt_tokens, "
            "completion_tokens, total_tokens, usage_source, endpoint, cached_tokens, "
            "cache_creation_tokens, reasoning_tokens, cost")
_INSERT = (f"INSERT INTO usage_events ({_COLUMNS}) VALUES ("
           + ",".join(["{p}"] * len(_COLUMNS.split(","))) + ") ON CONFLICT (event_id) DO NOTHING")
_TOTAL = """INSERT INTO usage_totals VALUES ({p},{p},{p},{p},1,{p},{p},{p})
            ON CONFLICT (day, team, key_id, model) DO UPDATE SET
              requests = usage_totals.requests + 1,
              prompt_tokens = usage_totals.prompt_tokens + excluded.prompt_tokens,
              completion_tokens = usage_totals.completion_tokens + excluded.completion_tokens,
              total_tokens = usage_totals.total_tokens + excluded.total_tokens"""
_DUP = """INSERT INTO ingest_stats VALUES ({p}, 1) ON CONFLICT (instance_id)
          DO UPDATE SET duplicates = ingest_stats.duplicates + 1"""
_SEEN = "INSERT INTO seen_seqs VALUES ({p},{p}) ON CONFLICT (instance_id, seq) DO NOTHING"
_REJECT = ("INSERT INTO rejected_records VALUES ({p},{p},{p},{p},{p}) "
           "ON CONFLICT (topic, kafka_partition, kafka_offset) DO NOTHING")
_READ = ("INSERT INTO read_partitions VALUES ({p},{p}) "
         "ON CONFLICT (topic, kafka_partition) DO NOTHING")
_ALL_READ = ("*", -1)  # the mark of a database filled before partitions were marked
_INT64_MAX = 2**63 - 1
_WRITER_LOCK = 0x6761746577617962  # "gatewayb": the advisory lock the billing writers take


@dataclass
class Ingested:
    new: int
    duplicates: int
    rejected: int = 0  # records quarantined by this call (not those already quarantined)


@dataclass(frozen=True)
class Rejected:
    """A record of the topic that is no usage event this database can take."""

    topic: str
    partition: int
    offset: int
    error: str
    value: bytes


def _utc(text: str) -> bool:
    try:
        at = datetime.fromisoformat(text.upper())  # RFC 3339 allows "t" and "z"
    except ValueError:
        return False
    return at.utcoffset() == timedelta(0)


def canonical_time(text: str) -> str:
    """A UTC RFC 3339 time (as `unfit` accepts it) as the gateway writes `ended_at`:
    milliseconds and "Z". Stored so, times compare as text in time order (the report's
    --since/--until and its days do): "+00:00", lowercase, no fraction or more digits
    would otherwise sort apart from the instants they name."""
    at = datetime.fromisoformat(text.upper()).astimezone(UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# DESIGN §6's outcomes: the report's request columns. An event with another is quarantined,
# not billed in no column (its tokens and cost counted, its request nowhere).
OUTCOMES = ("completed", "client_cancelled", "upstream_error", "denied")
# Outcomes the gateway emits only for a request a key was admitted for (billing.outcome:
# no key_id is `denied`): without its key or team, such an event would be billed to team "".
# Not upstream_error: the orphan sweep bills one for an admission whose stored who-and-what
# it cannot read (handoff.orphan_facts) with no key or team, and its tokens were charged.
_OWNED = ("completed", "client_cancelled")


def unfit(e: usage_pb2.UsageEvent) -> str:
    """Why `ingest` cannot take an event that parsed ("" if it can): what it keys, bills to
    a day or stores in a NOT NULL column must be there, and fit."""
    if not e.event_id:
        return "no event_id (the dedup key)"
    if not e.instance_id:
        return "no instance_id (the gap check's key)"
    if not 1 <= e.seq <= _INT64_MAX:
        return f"seq {e.seq} outside 1..2**63-1"
    if not _utc(e.ended_at):  # its first 10 characters are the day it is billed to
        return f"ended_at {e.ended_at[:40]!r} is not an RFC 3339 time in UTC"
    u = e.usage
    if min(u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens,
           u.reasoning_tokens, u.cache_creation_tokens) < 0:
        return "a negative token count"  # it would take tokens off the totals
    if not math.isfinite(e.cost):
        return f"cost {e.cost} is not a number"  # NaN is NULL to SQLite
    if e.cost < 0:
        return f"cost {e.cost} is negative"  # it would take money off the totals
    if e.outcome not in OUTCOMES:  # the report counts each request under one of them
        return f"outcome {e.outcome[:40]!r} is not one of {', '.join(OUTCOMES)}"
    if e.outcome in _OWNED and not (e.team and e.key_id):
        return (f"a {e.outcome} event with no {'team' if not e.team else 'key_id'}: it would "
                "be billed to no one")
    return ""


class UsageDb:
    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith(("postgresql://", "postgres://")):
            try:
                import psycopg
            except ImportError:  # a plain `pip install .`: psycopg is the `postgres` extra
                raise ImportError("PostgreSQL needs psycopg, not installed: pip install "
                                  "'gateway[postgres]' ('.[postgres]' from a checkout)") from None

            self.conn: Any = psycopg.connect(url)
            self.p = "%s"
            self._lock()  # consumers opening a new database at once: one creates its tables
        else:
            path = url.removeprefix("sqlite:///").removeprefix("sqlite://") or "usage.db"
            self.conn = sqlite3.connect(path, isolation_level=None)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.p = "?"
        marked_before = self._has_table("read_partitions")
        for stmt in SCHEMA:
            self._exec(stmt)
        self._add_columns()
        if self._exec("SELECT 1 FROM seen_seqs LIMIT 1").fetchone() is None:
            # a database from before seen_seqs: its events' seqs are what it saw
            self._exec("INSERT INTO seen_seqs SELECT instance_id, seq FROM usage_events WHERE true "
                       "ON CONFLICT (instance_id, seq) DO NOTHING")
        if not marked_before and self.has_events():
            # a database filled before partitions were marked: the consumer then read every
            # partition from its start while the database was empty, so all count as read
            self._exec(_READ, _ALL_READ)
        self._commit()

    def _has_table(self, name: str) -> bool:
        if isinstance(self.conn, sqlite3.Connection):
            sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = {p}"
        else:
            sql = "SELECT 1 WHERE to_regclass({p}) IS NOT NULL"  # in the search_path
        return self._exec(sql, (name,)).fetchone() is not None

    def _add_columns(self) -> None:
        if isinstance(self.conn, sqlite3.Connection):
            have = {r[1] for r in self.conn.execute("PRAGMA table_info(usage_events)")}
            for name, kind in ADDED:
                if name not in have:
                    self.conn.execute(f"ALTER TABLE usage_events ADD COLUMN {name} {kind}")
            return
        for name, kind in ADDED:
            self._exec(f"ALTER TABLE usage_events ADD COLUMN IF NOT EXISTS {name} {kind}")

    def _lock(self) -> None:
        """PostgreSQL: one writer at a time, until this transaction ends (as SQLite's BEGIN
        IMMEDIATE). Two consumers' batches otherwise update the same totals rows in their
        own orders and deadlock, and two creating the tables at once collide on
        CREATE TABLE IF NOT EXISTS."""
        self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITER_LOCK,))

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        return self.conn.execute(sql.format(p=self.p), args)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One write transaction, one writer at a time (SQLite: BEGIN IMMEDIATE; PostgreSQL:
        `_lock`), committed at the end, rolled back on any error."""
        sqlite = isinstance(self.conn, sqlite3.Connection)
        if sqlite:
            self.conn.execute("BEGIN IMMEDIATE")
        try:
            if not sqlite:
                self._lock()
            yield
        except BaseException:
            self.conn.rollback() if not sqlite else self.conn.execute("ROLLBACK")
            raise
        if sqlite:
            self.conn.execute("COMMIT")
        else:
            self.conn.commit()

    def _commit(self) -> None:
        if isinstance(self.conn, sqlite3.Connection):
            return
        self.conn.commit()

    def ingest(self, events: list[usage_pb2.UsageEvent],
               rejected: Sequence[Rejected] = ()) -> Ingested:
        """One transaction: dedup marks + aggregates for the whole batch, and the batch's
        unreadable records quarantined (each once, however often it is delivered)."""
        new = dup = quarantined = 0
        with self._writing():
            for e in events:
                u = e.usage
                ended = canonical_time(e.ended_at)
                self._exec(_SEEN, (e.instance_id, e.seq))
                cur = self._exec(_INSERT, (
                    e.event_id, e.instance_id, e.seq, ended, e.team, e.key_id, e.model,
                    e.outcome, u.prompt_tokens, u.completion_tokens, u.total_tokens,
                    e.usage_source, e.endpoint, u.cached_tokens, u.cache_creation_tokens,
                    u.reasoning_tokens, e.cost))
                if cur.rowcount == 1:
                    new += 1
                    self._exec(_TOTAL, (ended[:10], e.team, e.key_id, e.model,
                                        u.prompt_tokens, u.completion_tokens, u.total_tokens))
                else:
                    dup += 1
                    self._exec(_DUP, (e.instance_id,))
            for r in rejected:
                cur = self._exec(_REJECT, (r.topic, r.partition, r.offset, r.error,
                                           r.value.hex()))
                quarantined += cur.rowcount == 1
        return Ingested(new, dup, quarantined)

    def has_events(self) -> bool:
        """Whether `usage consume` ever filled this database (an empty report is suspect)."""
        return self._exec("SELECT 1 FROM usage_events LIMIT 1").fetchone() is not None

    def totals(self, columns: list[str], period_chars: int, since: str, until: str
               ) -> tuple[list[tuple[Any, ...]], str, str]:
        """Per `columns` (and the first `period_chars` of `ended_at`: 10 = the UTC day, 7 =
        the month, 0 = none), endpoint and outcome: requests, prompt, cached,
        cache-creation, completion and total tokens, and cost in integer units of 1e-9
        (events' costs are rounded to that, so the sum is exact and the same on SQLite and
        PostgreSQL, where a float SUM drifts), for events ended in [since,
        until) (RFC 3339 strings compare in time order); and the first and last event's end
        in that period."""
        where, args = ["1=1"], []
        if since:
            where.append("ended_at >= {p}")
            args.append(since)
        if until:
            where.append("ended_at < {p}")
            args.append(until)
        cond = " AND ".join(where)
        period = f"SUBSTR(ended_at, 1, {int(period_chars)})"  # 0: "" (PostgreSQL: no constant)
        keys = ", ".join([*columns, period, "endpoint", "outcome"])
        rows = self._exec(
            f"""SELECT {keys}, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens),
                  SUM(cache_creation_tokens), SUM(completion_tokens), SUM(total_tokens),
                  SUM(CAST(ROUND(cost * 1000000000) AS BIGINT))
                FROM usage_events WHERE {cond} GROUP BY {keys} ORDER BY {keys}""",
            tuple(args)).fetchall()
        span = self._exec(f"SELECT MIN(ended_at), MAX(ended_at) FROM usage_events WHERE {cond}",
                          tuple(args)).fetchone()
        return [tuple(r) for r in rows], span[0] or "", span[1] or ""

    def mark_read(self, partitions: Sequence[tuple[str, int]]) -> None:
        """These (topic, partition)s were read into this database and the group's offsets
        committed for them: from now on those offsets are this database's."""
        with self._writing():
            for topic, partition in sorted(set(partitions)):
                self._exec(_READ, (topic, partition))

    def unread(self, partitions: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Of these (topic, partition)s, those `usage consume` never read into this database
        (none, in a database filled before partitions were marked)."""
        have = {(str(t), int(p)) for t, p in
                self._exec("SELECT topic, kafka_partition FROM read_partitions").fetchall()}
        return [] if _ALL_READ in have else [tp for tp in partitions if tp not in have]

    def rejected(self, limit: int | None = None) -> tuple[int, list[Rejected]]:
        """How many records are quarantined, and the first `limit` (all if None) by topic
        position."""
        (count,) = self._exec("SELECT COUNT(*) FROM rejected_records").fetchone()
        sql = ("SELECT topic, kafka_partition, kafka_offset, error, value_hex FROM "
               "rejected_records ORDER BY topic, kafka_partition, kafka_offset")
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        rows = self._exec(sql).fetchall()
        return int(count), [Rejected(t, int(p), int(o), err, bytes.fromhex(v))
                            for t, p, o, err, v in rows]

    def seqs(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for inst, seq in self._exec(
                "SELECT instance_id, seq FROM seen_seqs ORDER BY instance_id, seq").fetchall():
            out.setdefault(inst, []).append(int(seq))
        return out

    def duplicates(self) -> dict[str, int]:
        rows = self._exec("SELECT instance_id, duplicates FROM ingest_stats").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def close(self) -> None:
        self.conn.close()


def gaps(seqs: list[int]) -> list[tuple[int, int]]:
    """Missing seq ranges (inclusive) from 1 up to the highest seen."""
    out, expect = [], 1
    for s in seqs:
        if s > expect:
            out.append((expect, s - 1))
        expect = max(expect, s + 1)
    return out
