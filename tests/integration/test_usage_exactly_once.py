"""`gateway usage consume` on a real Tansu, exactly once into the database: two consumers in
one group, a new group on a filled database, an event replayed weeks later, an offset
commit a rebalance refused, several partitions. Whatever happens, the report's totals are
the sum of the distinct events. (Killed -9 mid-stream, crashed between its commits:
test_usage_crashes.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from usage_kit import SESSION_S, event, expected, got, put, run

from devspoke.procs import Service, free_port, tansu_service
from gateway.billing.consumer import consume


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path_factory.mktemp("tansu")).start()
    yield svc
    svc.stop()


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
    """`usage consume --session-timeout-s` (these tests run on SESSION_S: a broker-side
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
