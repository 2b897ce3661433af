"""Several `gateway hub allocate` at once on a real Tansu (gateway/hub/fence.py): one
publishes allowances, the others fold the topics as a warm standby; a newer one takes
over at once, an older one within 3 of the active one's intervals when its heartbeats stop
(at once when it stops cleanly). The generations stay one sequence and the allowances in
force never add up to more than the quota."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from devspoke.procs import Service, free_port, tansu_service
from gateway.hub import fence
from gateway.hub import quota_topic as qt
from gateway.hub.allocator import Allocator
from gateway.hub.topics import produce, read_all
from gateway.usage_event import rfc3339

QUOTA = 1000
IV = 1.0  # the allocators' interval: the standby takes over within 3 of them
POLICY = {"revision": 1, "policy": {
    "teams": {"g": {"models": ["*"], "global_limits": {"tokens_per_day": QUOTA}}},
    "keys": {"k1": {"team": "g", "sha256": "a" * 64}}}}


@pytest.fixture
def kafka(tmp_path: Path) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path / "tansu").start()
    yield svc
    svc.stop()


async def until(cond: Callable[[], object], what: str, timeout: float = 30.0) -> float:
    """Seconds it took for `cond()` to hold."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def use(bs: str, spoke: str, eid: str, tokens: int) -> None:
    event = {"event_id": eid, "spoke": spoke, "team": "g", "key_id": "k1",
             "usage": {"total_tokens": str(tokens)}, "started_at": rfc3339(time.time())}
    await produce(bs, qt.USAGE_TOPIC, spoke, orjson.dumps(event), idempotence=False)


@pytest.mark.serial  # its claims are deadlines of 1 s (a clean stop) and 4 s (a death)
async def test_a_second_allocator_is_a_standby_that_takes_over_when_the_first_stops(
        kafka: Service) -> None:
    bs = kafka.address
    await produce(bs, qt.POLICY_TOPIC, "*", orjson.dumps(POLICY), idempotence=False)
    for spoke in ("east", "west"):  # their followers' hellos: both spokes are known
        hello = {"kind": "applied", "spoke": spoke, "generation": 0, "applied": [], "holds": 0}
        await produce(bs, qt.QUOTA_TOPIC, f"{spoke}/applied", orjson.dumps(hello),
                      idempotence=False)
    a = Allocator(bs, IV, idempotence=False, allocator_id="a")
    stop_a = asyncio.Event()
    run_a = asyncio.create_task(a.run(stop_a))
    await until(lambda: a.published >= 2, "a's first allowances")

    b = Allocator(bs, IV, idempotence=False, allocator_id="b")  # started later: it leads
    run_b = asyncio.create_task(b.run())
    handover = await until(lambda: b.ready, "b taking over from a")
    assert not a.ready and not a.fence.me.active
    assert handover < 3 * IV + 5, handover  # b's start: its first read, then a's withdrawal
    await use(bs, "east", "e1", 300)  # demand moves: new allowances, from b only
    await until(lambda: b.published >= 1, "b's allowances")
    published_by_a = a.published
    await asyncio.sleep(3 * IV)
    assert a.published == published_by_a  # the standby publishes nothing

    run_b.cancel()  # b dies (no tombstone): a waits out its heartbeats
    stopped = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await run_b
    await until(lambda: a.ready, "a taking over after b stopped")
    took = time.monotonic() - stopped  # b's last heartbeat was up to 1 interval old
    assert 1.5 * IV <= took <= 3 * IV + 1, took
    generation_b = b.ledger.generation
    await use(bs, "west", "w1", 200)
    await until(lambda: a.published > published_by_a, "a's allowances again")
    assert a.ledger.generation > generation_b  # one sequence, continued

    c = Allocator(bs, IV, idempotence=False, allocator_id="c")  # a rolling update's
    stop_c = asyncio.Event()
    run_c = asyncio.create_task(c.run(stop_c))
    await until(lambda: c.ready, "c taking over from a")
    await use(bs, "east", "e2", 100)
    await until(lambda: c.published >= 1, "c's allowances")
    published_by_a = a.published
    stop_c.set()  # stopped cleanly: its heartbeat removed, a need not wait it out
    stopped = time.monotonic()
    await run_c
    await until(lambda: a.ready, "a taking over after c stopped cleanly")
    clean = time.monotonic() - stopped
    assert clean < IV, clean
    await use(bs, "west", "w2", 100)
    await until(lambda: a.published > published_by_a, "a's allowances once more")
    stop_a.set()
    await run_a

    records = await read_all(bs, qt.QUOTA_TOPIC)
    assert (fence.heartbeat_key("a").decode(), None) in records  # stopped: said so
    writers = check_allowances(records)
    assert writers == ["a", "b", "a", "c", "a"], writers  # one at a time
    print(f"handover {handover:.2f} s, takeover {took:.2f} s, after a clean stop {clean:.2f} s")




def check_allowances(records: list[tuple[str, bytes | None]]) -> list[str]:
    """The allowance messages in generation order: no generation twice, and the newest
    allowance of each spoke never adding up to more than the quota. Returns the runs of
    their writers (["a", "b"]: a's, then b's)."""
    msgs = sorted((orjson.loads(v) for k, v in records
                   if v and (qt.parse_key(k.encode()) or ("",))[0] == "allowance"),
                  key=lambda m: m["generation"])
    generations = [m["generation"] for m in msgs]
    assert len(set(generations)) == len(generations), generations  # no number twice
    in_force: dict[str, int] = {}
    for m in msgs:  # the newest allowance of each spoke, after each message
        in_force[m["spoke"]] = sum(e["allowance"] for e in m["allowances"])
        assert sum(in_force.values()) <= QUOTA, (m["generation"], in_force)
    writers = [m["allocator"] for m in msgs]
    return [w for i, w in enumerate(writers) if i == 0 or writers[i - 1] != w]
