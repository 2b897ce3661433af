"""The hub's Kafka I/O on a real Tansu: reading a topic whole, following it, and saying
when Kafka is away."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from devspoke.procs import Service, free_port, tansu_service
from devspoke.stack import metric
from gateway.cli import main
from gateway.errors import SinkUnavailable
from gateway.hub import feed
from gateway.hub.feed import Record
from gateway.hub.publish import publish
from gateway.hub.status import Status, now_text
from gateway.hub.topics import (
    POLICY_TOPIC,
    STATUS_TOPIC,
    Follower,
    ensure_compacted,
    produce,
    read_all,
)


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path_factory.mktemp("tansu")).start()
    yield svc
    svc.stop()


async def test_a_topic_is_read_whole_in_order_and_a_missing_one_is_empty(
        tansu: Service) -> None:
    bs = tansu.address
    assert await read_all(bs, "hub.missing") == []
    await ensure_compacted(bs, "hub.t1")
    await ensure_compacted(bs, "hub.t1")  # already there: no error
    for key, value in [("*", b"1"), ("a", b"2"), ("*", b"3"), ("a", None)]:
        await produce(bs, "hub.t1", key, value, idempotence=False)
    records = await read_all(bs, "hub.t1")
    assert records == [("*", b"1"), ("a", b"2"), ("*", b"3"), ("a", None)]
    assert feed.latest(records) == {"*": b"3"}


async def until(batches: AsyncIterator[list[Record]], cond: Callable[[], object],
                seen: list[Record], timeout: float = 20.0) -> None:
    """Take batches (into `seen`) until `cond()` holds after one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.extend(await anext(batches))
        if cond():
            return
    raise AssertionError("condition not reached")


async def test_the_follower_says_when_kafka_is_away_and_reads_again_from_the_start(
        tansu: Service) -> None:
    bs = tansu.address
    await ensure_compacted(bs, "hub.t2")
    await produce(bs, "hub.t2", "*", b"first", idempotence=False)
    follower = Follower(bs, "hub.t2", probe_s=0.5)
    seen: list[Record] = []
    batches = follower.batches()
    try:
        await until(batches, lambda: follower.caught_up and seen, seen)
        assert follower.up and seen == [("*", b"first")]
        first = follower.generation

        tansu.pause()  # SIGSTOP: Kafka hangs
        try:
            await until(batches, lambda: not follower.up, seen)
            assert follower.error
        finally:
            tansu.resume()
        await produce(bs, "hub.t2", "*", b"second", idempotence=False)
        seen.clear()
        await until(batches, lambda: follower.up and follower.caught_up
                    and ("*", b"second") in seen, seen)
        assert follower.generation > first
        assert seen == [("*", b"first"), ("*", b"second")]  # from the start again
    finally:
        await batches.aclose()


@pytest.fixture
def feed_kafka(tmp_path: Path) -> Iterator[Service]:
    """A Tansu of its own: these tests write the policy feed, which others read as empty."""
    svc = tansu_service(free_port(), tmp_path / "tansu").start()
    yield svc
    svc.stop()


async def test_the_follower_outlives_a_broker_that_is_down_and_reads_it_again_once_back(
        feed_kafka: Service) -> None:
    """DESIGN §10: Kafka away, the syncer retries and says so. A broker that is down refuses
    connections (a paused one only hangs): aiokafka's stop() then raised CancelledError out
    of the follower, which ended `gateway policy sync`."""
    bs = feed_kafka.address
    await produce(bs, "hub.t3", "*", b"first", idempotence=False)
    follower = Follower(bs, "hub.t3", probe_s=0.5)
    seen: list[Record] = []
    batches = follower.batches()
    try:
        await until(batches, lambda: follower.caught_up and seen, seen)
        feed_kafka.stop()
        down = follower.generation
        await until(batches, lambda: follower.generation >= down + 3, seen)  # 3 tries, alive
        assert not follower.up and follower.error
        feed_kafka.start()  # memory storage: the topic comes back empty
        await produce(bs, "hub.t3", "*", b"second", idempotence=False)
        seen.clear()
        await until(batches, lambda: follower.up and ("*", b"second") in seen, seen)
    finally:
        await batches.aclose()


def test_policy_sync_and_the_allocator_outlive_a_broker_that_is_down(
        feed_kafka: Service, redis_server: Service, redis_url: str, tmp_path: Path) -> None:
    """The long-running hub commands keep what they hold and retry while the broker is down,
    rather than exit; once it is back, the syncer reports again on the status topic. The
    syncer's allowance follower says on /metrics whether Kafka and Redis answer it (Redis
    too between allowances, when it writes nothing), and `policy status` shows its line
    under the syncer's row."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]),
           "GATEWAY_KAFKA_BOOTSTRAP": feed_kafka.address, "GATEWAY_KAFKA_IDEMPOTENCE": "false",
           "GATEWAY_SPOKE": "s1", "GATEWAY_REDIS_URL": redis_url,
           "GATEWAY_STATUS_INTERVAL_S": "1", "GATEWAY_SYNC_STATE_DIR": str(tmp_path / "sync")}
    env.pop("GATEWAY_HUB_BOOTSTRAP", None)
    metrics_at = f"127.0.0.1:{free_port()}"
    metrics_url = f"http://{metrics_at}"
    cmds = {"sync": ["policy", "sync", "--id", "sync-1", "--metrics-listen", metrics_at],
            "allocate": ["hub", "allocate", "--interval-s", "1"]}
    logs = {name: tmp_path / f"{name}.log" for name in cmds}
    procs = {name: subprocess.Popen([sys.executable, "-m", "gateway", *argv], env=env,
                                    stdout=subprocess.DEVNULL,
                                    stderr=logs[name].open("wb"))
             for name, argv in cmds.items()}
    try:
        def reported() -> bool:
            return "s1/sync-1" in feed.latest(asyncio.run(read_all(feed_kafka.address,
                                                                   STATUS_TOPIC)))
        def quota_feed_up() -> float | None:
            return metric(metrics_url, "gateway_quota_feed_up")

        _wait(reported, "the syncer's first report")
        _wait(lambda: quota_feed_up() == 1, "the allowance follower reads llm.quota.v1")
        def policy_status() -> str:
            return subprocess.run([sys.executable, "-m", "gateway", "policy", "status"],
                                  env=env, capture_output=True, text=True, timeout=30).stdout

        _wait(lambda: "\n  allowances: none yet\n" in policy_status(),
              "the follower's line under the syncer's row of `policy status`")
        feed_kafka.stop()
        time.sleep(6)  # many failed fetches and reconnects
        dead = {name: logs[name].read_text()[-2000:] for name, proc in procs.items()
                if proc.poll() is not None}
        assert not dead, dead
        assert quota_feed_up() == 0
        feed_kafka.start()  # memory storage: every topic comes back empty
        _wait(reported, "a report once the broker is back")
        _wait(lambda: quota_feed_up() == 1, "the allowance follower reads again")
        assert metric(metrics_url, "gateway_quota_store_up") == 1
        redis_server.stop()
        _wait(lambda: metric(metrics_url, "gateway_quota_store_up") == 0,
              "the follower sees Redis gone with no allowance to write")
        redis_server.start()
        _wait(lambda: metric(metrics_url, "gateway_quota_store_up") == 1,
              "the follower sees Redis back")
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_hub_allocate_stops_quietly_on_ctrl_c(tansu: Service, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) ends the long-running allocator with exit 0 and no traceback, as it
    ends `policy sync`: it used to die in a KeyboardInterrupt traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]),
           "GATEWAY_KAFKA_BOOTSTRAP": tansu.address, "GATEWAY_KAFKA_IDEMPOTENCE": "false"}
    env.pop("GATEWAY_HUB_BOOTSTRAP", None)
    log = tmp_path / "allocate.log"
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "hub", "allocate",
                             "--interval-s", "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("wb"))
    try:
        _wait(lambda: "quota_allocator_resumed" in log.read_text(), "the allocator's start")
        time.sleep(0.5)  # into its polling loop
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()[-2000:]


def _wait(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except SinkUnavailable:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not reached: {what}")


def _data(model: str) -> dict[str, Any]:
    """A policy with model `model` and one key: `hub publish` refuses one without models or
    keys (unless --allow-empty)."""
    return {"models": {model: {}}, "teams": {"t": {"models": ["*"]}},
            "keys": {"k": {"team": "t", "sha256": "0" * 64}}}


def _doc(model: str) -> bytes:
    return orjson.dumps(_data(model))  # JSON is YAML


async def test_publishes_at_the_same_instant_each_land_under_a_number_of_their_own(
        feed_kafka: Service) -> None:
    """Eight publishes at once (each its own producer and reader, interleaved on one loop):
    all take the feed's last number + 1 to begin with, and the losers publish again."""
    bs = feed_kafka.address
    targets = ["*", "a", "*", "b", "a", "*", "b", "*"]
    revisions = await asyncio.gather(*(
        publish(bs, _doc(f"m{i}"), f"p{i}.yaml", spoke, idempotence=False)
        for i, spoke in enumerate(targets)))
    assert len(set(revisions)) == len(targets)  # one number each
    records = await read_all(bs, POLICY_TOPIC)
    for i, (spoke, rev) in enumerate(zip(targets, revisions, strict=True)):
        key, raw = feed.first_with(records, rev) or ("", b"")
        assert key == spoke and feed.parse_value(raw).policy == _data(f"m{i}")
    # A spoke that read the topic in order, keeping the first of a number, ends on what the
    # compacted topic holds for it (the two did not agree when two publishes shared one).
    for spoke in ("a", "b", "c"):
        held, doc = 0, None
        for n in range(1, len(records) + 1):  # the syncer's view after each record
            found = feed.entry_for(feed.latest(records[:n]), spoke)
            entry = feed.parse_value(found[1]) if found else None
            if entry is not None and entry.revision > held:
                held, doc = entry.revision, entry.policy
        _, raw = feed.entry_for(feed.latest(records), spoke) or ("", b"")
        assert (held, doc) == (feed.parse_value(raw).revision, feed.parse_value(raw).policy)


async def test_a_publish_that_lost_its_number_to_another_publishes_again_as_the_next(
        feed_kafka: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    bs = feed_kafka.address
    first = await publish(bs, _doc("before"), "p.yaml", idempotence=False)
    rival = feed.encode(first + 1, {"models": {"rival": {}}})
    sent: list[int] = []

    async def racing(bootstrap: str, topic: str, key: str, value: bytes | None,
                     *, idempotence: bool = True) -> None:
        if not sent:  # another hub's record of the same number lands just before ours
            await produce(bootstrap, topic, "*", rival, idempotence=False)
        sent.append(feed.parse_value(value or b"").revision)
        await produce(bootstrap, topic, key, value, idempotence=idempotence)

    monkeypatch.setattr("gateway.hub.publish.produce", racing)
    rev = await publish(bs, _doc("mine"), "p.yaml", idempotence=False)
    assert sent == [first + 1, first + 2] and rev == first + 2
    records = await read_all(bs, POLICY_TOPIC)
    assert feed.first_with(records, first + 1) == ("*", rival)
    assert feed.latest(records)["*"] == feed.encode(first + 2, _data("mine"))


RACED_PUBLISH = """
import sys
from gateway.hub import feed, publish
from gateway.hub.topics import produce
rivals = []

async def racing(bootstrap, topic, key, value, *, idempotence=True):
    if not rivals:  # another hub's record of the same number lands just before ours
        rivals.append(feed.parse_value(value).revision)
        await produce(bootstrap, topic, "*", feed.encode(rivals[0], {"models": {"rival": {}}}),
                      idempotence=False)
    await produce(bootstrap, topic, key, value, idempotence=idempotence)

publish.produce = racing
from gateway.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_hub_publish_prints_only_its_line_on_stdout_and_its_warnings_on_stderr(
        feed_kafka: Service, tmp_path: Path) -> None:
    """DESIGN §10: `hub publish` prints `published revision N for spoke ID`, which tools
    read. Its warnings (here a lost race: publish_raced) go to stderr, as every other
    command's logs do; unconfigured, structlog printed them on stdout, before that line."""
    doc = tmp_path / "p.json"
    doc.write_bytes(_doc("m"))
    run = subprocess.run(
        [sys.executable, "-c", RACED_PUBLISH, "hub", "publish", str(doc), "--bootstrap",
         feed_kafka.address], capture_output=True, text=True, timeout=60,
        env={**os.environ, "GATEWAY_KAFKA_IDEMPOTENCE": "false"})
    assert run.returncode == 0, run.stderr
    assert run.stdout == "published revision 2 for spoke *\n"  # 1 went to the rival
    assert "publish_raced" in run.stderr


def test_hub_publish_with_kafka_away_says_so_and_exits_1(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    doc = tmp_path / "p.yaml"
    doc.write_bytes(_doc("m"))
    assert main(["hub", "publish", str(doc), "--bootstrap", f"127.0.0.1:{free_port()}"]) == 1
    assert "error: kafka" in capsys.readouterr().err


def test_hub_status_of_an_empty_fleet(tansu: Service,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hub", "status", "--bootstrap", tansu.address]) == 0
    assert "no spoke has reported" in capsys.readouterr().out
    assert main(["hub", "status", "-o", "json", "--bootstrap", tansu.address]) == 0
    assert capsys.readouterr().out.strip() == '{"spokes":[]}'



async def test_a_publish_goes_above_what_the_spokes_hold_when_the_feed_has_less(
        feed_kafka: Service) -> None:
    """The hub's topic lost (it starts again at 1) or a local `policy apply`: a spoke that
    holds revision 7 would hold a published 1..7 as not newer. The next publish is 8."""
    bs = feed_kafka.address
    await ensure_compacted(bs, STATUS_TOPIC)
    await produce(bs, STATUS_TOPIC, "s1/i1", Status("s1", "i1", 7, "ack", None, now_text(), 0,
                                                    0.0, True).encode(), idempotence=False)
    assert await publish(bs, _doc("m"), "p.yaml", idempotence=False) == 8
    assert await publish(bs, _doc("n"), "p.yaml", idempotence=False) == 9  # then the feed's own


def test_a_publish_goes_above_a_hand_produced_revision_whose_policy_is_no_document(
        feed_kafka: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN §10: publish gives max-so-far + 1 over the topic. A record a tool produced by
    hand with a readable revision but no policy object is on the topic (its spoke NACKs it)
    as much as one whose document fails validation, which counted; it was skipped, and the
    next publish took a number below it (2, not 901)."""
    monkeypatch.setenv("GATEWAY_KAFKA_IDEMPOTENCE", "false")  # Tansu: no idempotent producer
    bs = feed_kafka.address
    doc = tmp_path / "p.yaml"
    doc.write_bytes(_doc("m"))
    asyncio.run(ensure_compacted(bs, POLICY_TOPIC))
    asyncio.run(produce(bs, POLICY_TOPIC, "*", feed.encode(1, _data("m")), idempotence=False))
    envelopes = [{"revision": 900, "policy": "not a document"}, {"revision": 910},
                 {"revision": 920, "policy": None}, {"revision": 930, "policy": [1]}]
    for envelope in envelopes:
        asyncio.run(produce(bs, POLICY_TOPIC, "q", orjson.dumps(envelope), idempotence=False))
        assert main(["hub", "publish", str(doc), "--bootstrap", bs]) == 0
        assert capsys.readouterr().out == \
            f"published revision {envelope['revision'] + 1} for spoke *\n"


async def test_a_status_topic_that_cannot_be_read_leaves_the_feeds_own_number(
        feed_kafka: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    bs = feed_kafka.address
    first = await publish(bs, _doc("m"), "p.yaml", idempotence=False)

    async def status_unreadable(bootstrap: str, topic: str, timeout: float = 10.0
                                ) -> list[Record]:
        if topic == STATUS_TOPIC:
            raise SinkUnavailable(f"kafka {bootstrap}: reading {topic}: too slow")
        return await read_all(bootstrap, topic, timeout)

    monkeypatch.setattr("gateway.hub.publish.read_all", status_unreadable)
    assert await publish(bs, _doc("n"), "p.yaml", idempotence=False) == first + 1


def test_a_feed_key_that_is_not_utf8_stops_no_reader(
        feed_kafka: Service, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A record whose key is not UTF-8 (no spoke id is; a foreign tool's, or a bit flipped):
    its key raised UnicodeDecodeError in every reader of the feed, so each later `hub
    publish` exited 2 ("nothing published") and `hub status` 1, and every syncer's follower
    crashed and began again forever, never taking the valid revisions beside it."""
    from aiokafka import AIOKafkaProducer
    bs = feed_kafka.address

    async def setup() -> int:
        first = await publish(bs, _doc("m"), "p.yaml", idempotence=False)
        p = AIOKafkaProducer(bootstrap_servers=bs, enable_idempotence=False)
        await p.start()
        try:
            await p.send_and_wait(POLICY_TOPIC, key=b"\xff\xfe",
                                  value=feed.encode(first + 1, _data("foreign")))
        finally:
            await p.stop()
        return first

    async def follow() -> dict[str, bytes]:
        follower = Follower(bs, POLICY_TOPIC, probe_s=0.5)
        seen: list[Record] = []
        batches = follower.batches()
        try:
            await until(batches, lambda: follower.up and follower.caught_up, seen)
        finally:
            await batches.aclose()
        return feed.latest(seen)

    first = asyncio.run(setup())
    monkeypatch.setenv("GATEWAY_KAFKA_IDEMPOTENCE", "false")  # Tansu: no idempotent producer
    doc = tmp_path / "p.json"
    doc.write_bytes(_doc("n"))
    assert main(["hub", "publish", str(doc), "--bootstrap", bs]) == 0
    # the foreign record's revision counts in the one sequence over the topic
    assert capsys.readouterr().out == f"published revision {first + 2} for spoke *\n"
    assert main(["hub", "status", "-o", "json", "--bootstrap", bs]) == 0
    capsys.readouterr()
    current = asyncio.run(follow())
    assert feed.entry_for(current, "east") == ("*", feed.encode(first + 2, _data("n")))


def test_hub_unpublish_removes_a_spokes_own_entry_and_never_stars(
        feed_kafka: Service, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setenv("GATEWAY_KAFKA_IDEMPOTENCE", "false")  # Tansu: no idempotent producer
    bs = feed_kafka.address
    doc = tmp_path / "p.yaml"
    doc.write_bytes(_doc("m"))
    for spoke in ("*", "a", "b"):
        assert main(["hub", "publish", str(doc), "--spoke", spoke, "--bootstrap", bs]) == 0
    capsys.readouterr()

    def entries() -> set[str]:
        return set(feed.latest(asyncio.run(read_all(bs, POLICY_TOPIC))))

    assert main(["hub", "unpublish", "a", "--bootstrap", bs]) == 0
    # '*' (revision 1) is below a's removed entry (2), which spoke a would keep holding (it
    # never moves to a lower revision): '*'s document goes out again as revision 4
    assert capsys.readouterr().out == ("removed the feed entry of spoke a: it follows '*'\n"
                                       "published '*' again as revision 4, above the "
                                       "removed entry\n")
    assert entries() == {"*", "b"}
    current = feed.latest(asyncio.run(read_all(bs, POLICY_TOPIC)))
    assert feed.entry_for(current, "a") == ("*", feed.encode(4, _data("m")))
    # '*', or a spoke without an entry of its own: exit 2, nothing removed
    assert main(["hub", "unpublish", "b", "*", "--bootstrap", bs]) == 2
    assert "'*' is every spoke's entry" in capsys.readouterr().err
    assert main(["hub", "unpublish", "b", "c", "--bootstrap", bs]) == 2
    assert "no entry of its own for c, now or before" in capsys.readouterr().err
    assert entries() == {"*", "b"}
    assert main(["hub", "publish", str(doc), "--spoke", "a", "--bootstrap", bs]) == 0
    assert capsys.readouterr().out == "published revision 5 for spoke a\n"  # numbers go on
    # '*' above the removed entry already: nothing published again
    assert main(["hub", "publish", str(doc), "--bootstrap", bs]) == 0
    capsys.readouterr()
    assert main(["hub", "unpublish", "a", "--bootstrap", bs]) == 0
    assert capsys.readouterr().out == "removed the feed entry of spoke a: it follows '*'\n"
    assert feed.max_revision(asyncio.run(read_all(bs, POLICY_TOPIC))) == 6


def test_hub_unpublish_that_failed_part_way_is_completed_by_running_it_again(
        feed_kafka: Service, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One tombstone per spoke: the broker failing after the first left a removed and b not,
    and the same command then refused a as "no entry of its own", so it could never be
    completed, nor '*' published again above what a held."""
    from gateway.hub import publish as publish_module
    monkeypatch.setenv("GATEWAY_KAFKA_IDEMPOTENCE", "false")  # Tansu: no idempotent producer
    bs = feed_kafka.address
    doc = tmp_path / "p.yaml"
    doc.write_bytes(_doc("m"))
    for spoke in ("*", "a", "b"):  # revisions 1, 2, 3
        assert main(["hub", "publish", str(doc), "--spoke", spoke, "--bootstrap", bs]) == 0
    capsys.readouterr()
    real, calls = publish_module.produce, []

    async def second_fails(*args: Any, **kwargs: Any) -> None:
        calls.append(args[2])
        if len(calls) == 2:
            raise SinkUnavailable("broker away")
        await real(*args, **kwargs)

    monkeypatch.setattr(publish_module, "produce", second_fails)
    assert main(["hub", "unpublish", "a", "b", "--bootstrap", bs]) == 1
    err = capsys.readouterr().err
    assert "removed the feed entry of a; not of b (broker away): run the same command " \
           "again" in err, err
    monkeypatch.setattr(publish_module, "produce", real)
    assert main(["hub", "unpublish", "a", "b", "--bootstrap", bs]) == 0
    assert capsys.readouterr().out == (
        "removed the feed entry of spoke a (already, by an earlier run): it follows '*'\n"
        "removed the feed entry of spoke b: it follows '*'\n"
        "published '*' again as revision 4, above the removed entries\n")
    current = feed.latest(asyncio.run(read_all(bs, POLICY_TOPIC)))
    assert set(current) == {"*"} and current["*"] == feed.encode(4, _data("m"))
    # done: once more changes nothing
    assert main(["hub", "unpublish", "a", "b", "--bootstrap", bs]) == 0
    assert "published" not in capsys.readouterr().out
    assert feed.max_revision(asyncio.run(read_all(bs, POLICY_TOPIC))) == 4


def test_hub_forget_removes_an_instance_that_stopped_reporting_from_hub_status(
        feed_kafka: Service, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GATEWAY_KAFKA_IDEMPOTENCE", "false")  # Tansu: no idempotent producer
    bs = feed_kafka.address

    async def report(*keys: str) -> None:
        await ensure_compacted(bs, STATUS_TOPIC)
        for key in keys:
            spoke, instance = key.split("/")
            await produce(bs, STATUS_TOPIC, key, Status(
                spoke, instance, 3, "ack", None, now_text(), 0, 0.0, True).encode(),
                idempotence=False)

    def listed() -> list[str]:
        assert main(["hub", "status", "-o", "json", "--bootstrap", bs]) == 0
        view = orjson.loads(capsys.readouterr().out)
        return [f"{s['spoke']}/{i['instance']}" for s in view["spokes"] for i in s["instances"]]

    asyncio.run(report("s1/old", "s1/live", "s2/gone"))
    assert listed() == ["s1/live", "s1/old", "s2/gone"]
    assert main(["hub", "forget", "s1/old", "s2/gone", "--bootstrap", bs]) == 0
    assert capsys.readouterr().out == "forgot s1/old\nforgot s2/gone\n"
    assert listed() == ["s1/live"]
    # Unknown or malformed: exit 2, nothing forgotten.
    assert main(["hub", "forget", "s1/live", "s1/old", "--bootstrap", bs]) == 2
    assert "no report from s1/old" in capsys.readouterr().err
    assert main(["hub", "forget", "s1-live", "--bootstrap", bs]) == 2
    assert "not SPOKE/INSTANCE: s1-live" in capsys.readouterr().err
    assert listed() == ["s1/live"]
    asyncio.run(report("s1/old"))  # a live instance comes back with its next report
    assert listed() == ["s1/live", "s1/old"]


async def _cleanup_policy(bs: str, topic: str, setting: str = "cleanup.policy") -> str | None:
    """`setting` as the broker describes `topic` (None: not set)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    admin = AIOKafkaAdminClient(bootstrap_servers=bs)
    await admin.start()
    try:
        answers = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    for answer in answers:
        for resource in answer.resources:
            for name, value, *_ in resource[4]:
                if name == setting:
                    return str(value)
    return None


async def test_the_first_status_report_makes_the_status_topic_compacted(
        feed_kafka: Service) -> None:
    """DESIGN §10: `llm.gateway.status.v1` is compacted. The first `gateway serve` or
    syncer to report creates it so, rather than the broker auto-creating it plain."""
    from gateway.hub.status import StatusReporter
    bs = feed_kafka.address
    reporter = StatusReporter(bs, lambda: Status("s1", "i1", 1, "ack", None, now_text(), 0,
                                                 0.0, True), 10.0, idempotence=False)
    try:
        await reporter.send_now()
    finally:
        await reporter.producer.close()
    assert reporter.sent == 1
    assert await _cleanup_policy(bs, STATUS_TOPIC) == "compact"
    # compacted within the hour by a Kafka (Tansu stores it, quirk 4): not after a week
    assert await _cleanup_policy(bs, STATUS_TOPIC, "segment.ms") == "3600000"
    assert feed.latest(await read_all(bs, STATUS_TOPIC)).keys() == {"s1/i1"}


async def test_the_first_quota_message_makes_the_quota_topic_compacted(
        feed_kafka: Service) -> None:
    """`llm.quota.v1` is compacted (docs/contracts.md): the allocator's or a follower's first
    message creates it so."""
    from gateway.hub import quota_topic as qt
    bs = feed_kafka.address
    pub = qt.QuotaPublisher(bs, idempotence=False)
    try:
        await pub.publish(qt.applied_key("s1"), {"generation": 0, "allowances": []})
    finally:
        await pub.close()
    assert await _cleanup_policy(bs, qt.QUOTA_TOPIC) == "compact"
    assert await _cleanup_policy(bs, qt.QUOTA_TOPIC, "segment.ms") == "3600000"


async def _replicas(bs: str, topic: str) -> list[int]:
    """The replica list of `topic`'s partition 0 as the broker describes it."""
    from aiokafka.admin import AIOKafkaAdminClient
    admin = AIOKafkaAdminClient(bootstrap_servers=bs)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return list(described["partitions"][0]["replicas"])


async def test_the_hub_topics_are_created_with_the_replication_factor_asked(
        feed_kafka: Service, capsys: pytest.CaptureFixture[str]) -> None:
    """GATEWAY_TOPIC_REPLICATION on a real broker. Its default, 1, makes the feed compacted
    on one replica as before. A factor of 3 reaches the broker from the status and quota
    writers; Tansu (one broker) takes it without a word, listing its one broker three
    times (docs/kafka-broker.md quirk 14), so the refusal a Kafka of fewer brokers gives
    (INVALID_REPLICATION_FACTOR) is tested with a stand-in broker
    (tests/unit/test_hub_topic_settings.py). An existing topic is never changed."""
    from gateway.hub import quota_topic as qt
    from gateway.hub.status import StatusReporter
    from gateway.log import configure
    configure("info", cache=False)
    bs = feed_kafka.address
    await publish(bs, _doc("m"), "p.yaml", idempotence=False)
    assert await _cleanup_policy(bs, POLICY_TOPIC) == "compact"
    assert len(await _replicas(bs, POLICY_TOPIC)) == 1

    reporter = StatusReporter(bs, lambda: Status("s1", "i1", 1, "ack", None, now_text(), 0,
                                                 0.0, True), 10.0, idempotence=False,
                              replication=3)
    pub = qt.QuotaPublisher(bs, idempotence=False, replication=3)
    try:
        await reporter.send_now()
        await pub.publish(qt.applied_key("s1"), {"generation": 0, "allowances": []})
    finally:
        await reporter.producer.close()
        await pub.close()
    assert reporter.sent == 1
    for topic in (STATUS_TOPIC, qt.QUOTA_TOPIC):
        assert await _cleanup_policy(bs, topic) == "compact"
        assert len(await _replicas(bs, topic)) == 3
    await publish(bs, _doc("n"), "p.yaml", idempotence=False, replication=3)
    assert len(await _replicas(bs, POLICY_TOPIC)) == 1  # already there: left as it is
    assert "topic_not_created" not in capsys.readouterr().err


async def test_a_refused_feed_is_looked_for_in_the_broker_s_topic_list(
        tansu: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """The existence check after a refused creation, on a real broker's metadata (Tansu
    takes any creation, so the refusal is stood in): a topic made beforehand is found and
    used; a missing one is TopicRefused, and the check did not make it either."""
    from types import SimpleNamespace

    from aiokafka.admin import AIOKafkaAdminClient

    from gateway.errors import TopicRefused
    from gateway.hub import topics
    bs = tansu.address
    await ensure_compacted(bs, "hub.pre")  # the operator's, made beforehand

    class _Refusing(AIOKafkaAdminClient):
        async def create_topics(self, new: list[Any], *_: Any, **__: Any) -> Any:
            return SimpleNamespace(topic_errors=[(new[0].name, 29, "not authorized")])

    monkeypatch.setattr(topics, "AIOKafkaAdminClient", _Refusing)
    assert await ensure_compacted(bs, "hub.pre", required=True) is True
    with pytest.raises(TopicRefused, match=r"hub\.absent \(error 29 TOPIC_AUTHORIZATION_FAILED"):
        await ensure_compacted(bs, "hub.absent", required=True)
    admin = AIOKafkaAdminClient(bootstrap_servers=bs)
    await admin.start()
    try:
        names = await admin.list_topics()
    finally:
        await admin.close()
    assert "hub.pre" in names and "hub.absent" not in names


async def test_a_policy_of_more_than_a_megabyte_is_published_and_read_back(
        feed_kafka: Service) -> None:
    """A platform with ~10,000 keys has a policy document over 1 MB: aiokafka's default
    max_request_size (1 MiB) refused it ('MessageSizeTooLargeError', exit 1, as if Kafka were
    away), so no spoke could ever take it. Compressed, with the topic's own
    max.message.bytes raised for a Kafka that applies it (Tansu stores it, quirk 4)."""
    import hashlib
    bs = feed_kafka.address
    data = _data("big")
    data["keys"] = {f"key_{i:06d}": {"team": "t", "sha256": hashlib.sha256(
        str(i).encode()).hexdigest()} for i in range(12000)}
    text = orjson.dumps(data)
    assert len(text) > 1 << 20
    revision = await publish(bs, text, "big.json", idempotence=False)
    _, raw = feed.entry_for(feed.latest(await read_all(bs, POLICY_TOPIC)), "s1") or ("", b"")
    decision = feed.decide(f"{POLICY_TOPIC}[*]", raw, held=0)
    assert isinstance(decision, feed.Apply) and decision.revision == revision
    assert len(decision.doc.keys) == 12000
    assert int(await _cleanup_policy(bs, POLICY_TOPIC, "max.message.bytes") or 0) >= 16 << 20


async def test_a_nack_whose_error_is_huge_is_still_reported(feed_kafka: Service) -> None:
    """A revision refused for every one of 30,000 keys has an error of ~1.3 MB: a Kafka with
    its default record limit (1 MB; Tansu has none) refuses such a report, so every report
    (heartbeats too) would be dropped and the instance go silent in `hub status` exactly
    when it refuses, and the table printed it on one line. The error is cut, naming how much
    was left out."""
    from gateway.hub.status import StatusReporter
    bs = feed_kafka.address
    problems = "; ".join(f"keys.key_{i:06d}.team: unknown team 'gone'" for i in range(30000))
    error = f"llm.policy.v1[*] revision 9: {problems}"
    assert len(error) > 1 << 20
    reporter = StatusReporter(bs, lambda: Status("s1", "big", 8, "nack", error, now_text(),
                                                 0, 0.0, True), 10.0, idempotence=False)
    try:
        await reporter.send_now()
    finally:
        await reporter.producer.close()
    assert reporter.sent == 1
    got = orjson.loads(feed.latest(await read_all(bs, STATUS_TOPIC))["s1/big"])
    assert got["state"] == "nack" and got["revision"] == 8
    assert got["error"].startswith("llm.policy.v1[*] revision 9: keys.key_000000.team: ")
    assert len(got["error"]) <= 4096 and "more characters left out" in got["error"]


@pytest.mark.parametrize("codec", ["lz4", "snappy", "zstd"])
async def test_a_feed_record_a_foreign_producer_compressed_is_read(
        feed_kafka: Service, codec: str) -> None:
    """A hub's own tools may write the feed with any of Kafka's codecs (or a topic's
    compression.type may make the broker recompress ours): without the codec installed,
    aiokafka raises on the batch, and every spoke's follower took no revision at all."""
    from aiokafka import AIOKafkaProducer
    bs = feed_kafka.address
    producer = AIOKafkaProducer(bootstrap_servers=bs, compression_type=codec)
    await producer.start()
    try:
        await producer.send_and_wait(POLICY_TOPIC, feed.encode(7, _data(codec)), key=b"*")
    finally:
        await producer.stop()
    decision = feed.decide(f"{POLICY_TOPIC}[*]",
                           feed.latest(await read_all(bs, POLICY_TOPIC))["*"], held=0)
    assert isinstance(decision, feed.Apply) and decision.revision == 7


def test_hub_unpublish_run_again_after_compaction_changes_nothing_and_says_so(
        feed_kafka: Service, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Compaction drops a removed spoke's value and keeps its tombstone (produced here by
    hand, a tombstone with no value before it): what the spoke held is unknown, and every
    run again published '*' once more, as a new revision. A '*' written after the tombstone
    is above it; one written before goes out again once."""
    monkeypatch.setenv("GATEWAY_KAFKA_IDEMPOTENCE", "false")  # Tansu: no idempotent producer
    bs = feed_kafka.address
    doc = tmp_path / "p.yaml"
    doc.write_bytes(_doc("m"))
    asyncio.run(ensure_compacted(bs, POLICY_TOPIC, required=True))
    asyncio.run(produce(bs, POLICY_TOPIC, "a", None, idempotence=False))
    assert main(["hub", "publish", str(doc), "--bootstrap", bs]) == 0  # '*' after a's
    asyncio.run(produce(bs, POLICY_TOPIC, "b", None, idempotence=False))  # '*' before b's
    first = feed.max_revision(asyncio.run(read_all(bs, POLICY_TOPIC)))
    capsys.readouterr()
    assert main(["hub", "unpublish", "a", "--bootstrap", bs]) == 0
    assert capsys.readouterr().out == (
        "removed the feed entry of spoke a (already, by an earlier run): it follows '*'\n"
        "nothing changed: an earlier run completed it\n")
    assert main(["hub", "unpublish", "a", "b", "--bootstrap", bs]) == 0
    assert capsys.readouterr().out.endswith(
        f"published '*' again as revision {first + 1}, above the removed entries\n")
    for _ in range(2):
        assert main(["hub", "unpublish", "b", "a", "--bootstrap", bs]) == 0
        assert "nothing changed: an earlier run completed it" in capsys.readouterr().out
    assert feed.max_revision(asyncio.run(read_all(bs, POLICY_TOPIC))) == first + 1
