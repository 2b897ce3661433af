"""`gateway usage consume` on a real Tansu, exactly once into the database: killed (-9)
mid-batch, crashed between its database commit and its offset commit, two consumers in one
group, a new group on a filled database, an event replayed weeks later, several partitions.
Whatever happens, the report's totals are the sum of the distinct events."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from devspoke.procs import Service, free_port, tansu_service
from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.billing import report
from gateway.billing.consumer import consume
from gateway.billing.db import UsageDb
from gateway.sinks.usage_proto import proto_json

PARTITIONS = 3
# The group session (`--session-timeout-s`): Tansu holds a JoinGroup for half of it, and a
# member killed -9 holds its partitions for all of it; the default 6 s made each join here
# 3 to 12 s. A batch of 1000 holds the loop (and the heartbeats, every session/6) ~0.15 s
# idle, more loaded: 2 s leaves them slack (1 s: this file in 30 s idle against 45, as slow
# loaded).
SESSION_S = 2.0


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path_factory.mktemp("tansu")).start()
    yield svc
    svc.stop()


def event(i: int, ended: str = "2026-12-01T10:00:00.000Z") -> usage_pb2.UsageEvent:
    return usage_pb2.UsageEvent(
        event_id=f"e{i}", instance_id="i1", seq=i, ended_at=ended, team=f"t{i % 3}",
        key_id=f"k{i % 5}", model=f"m{i % 2}", outcome="completed", usage_source="reported",
        endpoint="/v1/chat/completions", cost=round(i * 1e-6, 9),
        usage=usage_pb2.Usage(prompt_tokens=i, completion_tokens=2, total_tokens=i + 2))


async def _topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()


async def _put(bootstrap: str, topic: str, events: list[usage_pb2.UsageEvent]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await p.start()
    try:
        for e in events:  # keyed by event_id, as the gateway produces: spread over partitions
            await p.send(topic, key=e.event_id.encode(), value=proto_json(e))
        await p.flush()
    finally:
        await p.stop()


def put(tansu: Service, topic: str, events: list[usage_pb2.UsageEvent],
        create: bool = False) -> None:
    if create:
        asyncio.run(_topic(tansu.address, topic))
    asyncio.run(_put(tansu.address, topic, events))


def expected(events: list[usage_pb2.UsageEvent]) -> dict[str, tuple[int, int, int]]:
    """team -> (requests, total tokens, cost in nanos), each event_id once."""
    out: dict[str, tuple[int, int, int]] = {}
    for e in {e.event_id: e for e in events}.values():
        n, t, c = out.get(e.team, (0, 0, 0))
        out[e.team] = (n + 1, t + e.usage.total_tokens, c + round(e.cost * 1e9))
    return out


def got(url: str, since: str = "", until: str = "") -> dict[str, tuple[int, int, int]]:
    db = UsageDb(url)
    try:
        return {r.name: (r.completed, r.total_tokens, round(r.cost * 1e9))
                for r in report.report(db, "team", since, until).rows}
    finally:
        db.close()


def run(tansu: Service, topic: str, url: str, group: str) -> int:
    """`group` on this topic only: a group is the broker's, and another test's (a member
    killed -9 still in it until its session expires) must not hold this one's join."""
    return asyncio.run(consume(tansu.address, topic, url, f"{group}.{topic}",
                               until_caught_up=True, session_timeout_s=SESSION_S))


def test_a_crash_between_the_db_commit_and_the_offset_commit_is_re_read_and_deduped(
        tansu: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topic, url = "usage.crash", f"sqlite:///{tmp_path / 'u.db'}"
    events = [event(i) for i in range(1, 301)]
    put(tansu, topic, events, create=True)

    from aiokafka import AIOKafkaConsumer

    async def dies(self: AIOKafkaConsumer, *a: object, **k: object) -> None:
        raise KeyboardInterrupt  # the process goes: the batch is in the database, no offset

    with monkeypatch.context() as m:
        m.setattr(AIOKafkaConsumer, "commit", dies)
        with pytest.raises(KeyboardInterrupt):
            run(tansu, topic, url, "g")
    first = UsageDb(url)
    held = sum(len(s) for s in first.seqs().values())
    first.close()
    assert held > 0
    assert run(tansu, topic, url, "g") == len(events) - held  # re-read: the rest is new
    assert sum(UsageDb(url).duplicates().values()) == held  # ... and what it held, dropped
    assert got(url) == expected(events)


def test_kill_9_mid_stream_loses_nothing_and_counts_nothing_twice(
        tansu: Service, tmp_path: Path) -> None:
    topic, url = "usage.kill9", f"sqlite:///{tmp_path / 'u.db'}"
    events = [event(i) for i in range(1, 6001)]
    put(tansu, topic, events, create=True)
    env = {**os.environ, "GATEWAY_USAGE_TOPIC": topic, "PYTHONPATH": os.getcwd()}
    argv = [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())",
            "usage", "consume", "--kafka", tansu.address,
            "--db", url, "--group", f"g.{topic}", "--session-timeout-s", str(SESSION_S)]
    for _ in range(3):  # killed as soon as its first batch is in, three times over
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        while b"usage_ingested" not in proc.stderr.readline():
            assert time.monotonic() < deadline and proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert run(tansu, topic, url, "g") > 0  # the kills were mid-stream: some was left
    assert got(url) == expected(events)


def test_two_consumers_in_one_group_and_a_new_group_on_a_filled_db(
        tansu: Service, tmp_path: Path) -> None:
    topic, url = "usage.two", f"sqlite:///{tmp_path / 'u.db'}"
    events = [event(i) for i in range(1, 2001)]
    put(tansu, topic, events, create=True)

    async def both() -> list[int]:
        return list(await asyncio.gather(
            consume(tansu.address, topic, url, f"g.{topic}", until_caught_up=True,
                    session_timeout_s=SESSION_S),
            consume(tansu.address, topic, url, f"g.{topic}", until_caught_up=True,
                    session_timeout_s=SESSION_S)))

    asyncio.run(both())
    assert got(url) == expected(events)
    assert run(tansu, topic, url, "other") == 0  # a new group: all re-read, all duplicates
    assert got(url) == expected(events)


def test_an_event_replayed_weeks_later_is_billed_once(tansu: Service, tmp_path: Path) -> None:
    topic, url = "usage.replay", f"sqlite:///{tmp_path / 'u.db'}"
    events = [event(i) for i in range(1, 51)]
    put(tansu, topic, events, create=True)
    assert run(tansu, topic, url, "g") == 50
    put(tansu, topic, [event(i) for i in range(60, 62)] + events[:10])  # weeks later
    assert run(tansu, topic, url, "g") == 2
    assert got(url) == expected([*events, event(60), event(61)])


def test_a_new_db_on_an_existing_group_crashing_after_its_first_batch_loses_nothing(
        tansu: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's offsets are at the end (another database read the topic); a new database
    reads every partition from its start, also when it crashes after its first batch (it
    then holds events, but has not read every partition)."""
    topic = "usage.newdb"
    old, new = (f"sqlite:///{tmp_path / n}" for n in ("old.db", "new.db"))
    events = [event(i) for i in range(1, 3001)]
    put(tansu, topic, events, create=True)
    assert run(tansu, topic, old, "g") == len(events)

    from aiokafka import AIOKafkaConsumer

    async def dies(self: AIOKafkaConsumer, *a: object, **k: object) -> None:
        raise KeyboardInterrupt

    real = AIOKafkaConsumer.getmany

    async def one_partition(self: AIOKafkaConsumer, *a: object, **k: object) -> object:
        got = await real(self, *a, **k)  # type: ignore[arg-type]
        # a first batch of part of one partition: in the database, marked nowhere (the
        # group's offset there is still the old database's, at its end)
        return {tp: msgs[:10] for tp, msgs in list(got.items())[:1]}

    with monkeypatch.context() as m:
        m.setattr(AIOKafkaConsumer, "commit", dies)
        m.setattr(AIOKafkaConsumer, "getmany", one_partition)
        with pytest.raises(KeyboardInterrupt):
            run(tansu, topic, new, "g")
    assert 0 < sum(len(s) for s in UsageDb(new).seqs().values()) < len(events)
    run(tansu, topic, new, "g")
    assert got(new) == expected(events)


def test_an_offset_commit_refused_by_a_rebalance_does_not_stop_the_consumer(
        tansu: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Another consumer joined the group between a batch's database commit and its offset
    commit: the broker refuses the commit (CommitFailedError). The batch is in the database;
    whoever now owns its partitions re-reads it and drops it as duplicates. The consumer goes
    on rather than exiting 1, as a group member must through a rebalance."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.errors import CommitFailedError

    from gateway.log import configure

    configure("info", cache=False)
    topic, url = "usage.rebalance", f"sqlite:///{tmp_path / 'u.db'}"
    events = [event(i) for i in range(1, 301)]
    put(tansu, topic, events, create=True)
    real, refused = AIOKafkaConsumer.commit, []

    async def once(self: AIOKafkaConsumer, *a: object, **k: object) -> None:
        if not refused:
            refused.append(1)
            raise CommitFailedError("the group rebalanced")
        await real(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(AIOKafkaConsumer, "commit", once)
    run(tansu, topic, url, "g")
    assert got(url) == expected(events)
    assert "usage_offsets_not_committed" in capsys.readouterr().err


def test_the_session_timeout_flag_is_the_groups_session(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`usage consume --session-timeout-s` (the tests above run on SESSION_S: a broker-side
    session, so nothing here would fail were it dropped on its way): the consumer's
    session, heartbeats at a sixth of it; 6 s unless given."""
    import gateway.billing.consumer as consumer_module
    from gateway.cli import main

    class Made(Exception):
        pass

    made: list[dict[str, object]] = []

    def consumer(**kw: object) -> None:
        made.append(kw)
        raise Made

    monkeypatch.setattr(consumer_module, "AIOKafkaConsumer", consumer)
    argv = ["usage", "consume", "--kafka", "127.0.0.1:1", "--db",
            f"sqlite:///{tmp_path / 'u.db'}"]
    for extra in (["--session-timeout-s", "1.5"], []):
        with pytest.raises(Made):
            main([*argv, *extra])
    assert [(m["session_timeout_ms"], m["heartbeat_interval_ms"]) for m in made] == [
        (1500, 250), (6000, 1000)]
