"""`gateway usage consume` on a real Tansu, crashed: killed (-9) mid-stream, crashed between
its database commit and its offset commit, a new database crashing after its first batch.
Whatever happens, the report's totals are the sum of the distinct events. (Groups and
rebalances: test_usage_exactly_once.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from usage_kit import SESSION_S, event, expected, got, put, run

from devspoke.procs import Service, free_port, tansu_service
from gateway.billing.db import UsageDb


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path_factory.mktemp("tansu")).start()
    yield svc
    svc.stop()


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
