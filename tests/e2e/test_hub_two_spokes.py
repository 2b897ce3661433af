"""The hub's contract (DESIGN §10) on two whole spokes sharing one Kafka (Tansu): two Redis,
two sidecars, two Envoys, two `gateway policy sync`; the hub is `gateway hub publish|status`.

The tests share one fleet and run in order: each leaves it serving the newest `*` revision.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from devspoke.procs import Service
from devspoke.stack import Spoke
from gateway.hub import feed
from gateway.hub.topics import POLICY_TOPIC, produce, read_all
from gateway.policy import secrets
from testkit.fleet import Fleet, start_fleet
from testkit.spoke import policy_doc

A, B = "spoke-a", "spoke-b"
BAD_POLICY = {"models": {"m": {"limits": {"rps": -3}}}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = start_fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    f.stop()


def answer(spoke: Spoke, secret: str) -> int:
    r = httpx.post(f"{spoke.base_url}/chat/completions", headers={"x-api-key": secret},
                   json={"model": "mock-model", "messages": [], "max_tokens": 1}, timeout=10)
    return r.status_code


def with_key(fleet: Fleet, key_id: str) -> tuple[dict[str, Any], str]:
    """The test policy plus a new key `key_id`; the document and the key's secret."""
    secret = secrets.new_secret(key_id)
    doc = deepcopy(policy_doc(fleet.keys))
    doc["keys"][key_id] = {"team": "t1", "sha256": secrets.digest(secret).hex()}
    return doc, secret


def put_on_feed(fleet: Fleet, key: str, value: bytes | None) -> None:
    """A record written to the feed directly, as a buggy or hostile hub could."""
    asyncio.run(produce(fleet.bootstrap, POLICY_TOPIC, key, value, idempotence=False))


def feed_max(fleet: Fleet) -> int:
    return feed.max_revision(asyncio.run(read_all(fleet.bootstrap, POLICY_TOPIC)))


def syncer_line(fleet: Fleet, spoke: str) -> dict[str, Any]:
    """The syncer's own line in its spoke's Redis (what `gateway policy status` shows)."""
    raw = fleet.redis(spoke).hget("gw:policy:sync", f"{spoke}-sync")
    return orjson.loads(raw) if raw else {}


def metric(svc: Service, name: str) -> float | None:
    with urllib.request.urlopen(f"http://{svc.address}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_a_published_revision_is_served_by_both_spokes(fleet: Fleet) -> None:
    assert all(answer(s, fleet.keys["good"]) == 200 for s in fleet.spokes.values())
    doc, secret = with_key(fleet, "fresh")
    assert answer(fleet.spokes[A], secret) == 401
    rev = fleet.publish(doc)
    took = fleet.wait(lambda: all(answer(s, secret) == 200 for s in fleet.spokes.values()),
                      "the new key served by both spokes")
    print(f"hub publish → served by both spokes: {took * 1000:.0f} ms")  # bench_hub: p50/p99
    assert fleet.held(A) == fleet.held(B) == rev  # Redis holds the feed's own number


def test_a_spokes_own_entry_reaches_only_that_spoke(fleet: Fleet) -> None:
    before = fleet.held(B)
    doc, secret = with_key(fleet, "only_a")
    rev = fleet.publish(doc, spoke=A)
    fleet.wait(lambda: answer(fleet.spokes[A], secret) == 200, "spoke-a serves its own entry")
    applied_at = time.time()
    fleet.wait(lambda: syncer_line(fleet, B).get("seen_at", 0) > applied_at + 1,
               "spoke-b's syncer went round after it")
    assert fleet.held(A) == rev and fleet.held(B) == before
    assert answer(fleet.spokes[B], secret) == 401

    # Its own entry removed (a tombstone), spoke-a follows `*` again from the next revision.
    put_on_feed(fleet, A, None)
    doc, back = with_key(fleet, "back")
    rev = fleet.publish(doc)
    fleet.wait(lambda: all(answer(s, back) == 200 for s in fleet.spokes.values()),
               "the next * revision served by both")
    assert answer(fleet.spokes[A], secret) == 401
    assert fleet.held(A) == fleet.held(B) == rev


def test_an_invalid_file_publishes_nothing(fleet: Fleet, tmp_path: Path) -> None:
    before = feed_max(fleet)
    bad = tmp_path / "bad.yaml"
    bad.write_text(orjson.dumps(BAD_POLICY).decode())
    proc = fleet.hub("publish", str(bad), check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}: models.m.limits.rps" in proc.stderr and proc.stdout == ""
    assert feed_max(fleet) == before


def test_a_corrupt_revision_is_nacked_upward_and_never_reaches_redis(fleet: Fleet) -> None:
    held = fleet.held(B)
    put_on_feed(fleet, B, feed.encode(feed_max(fleet) + 1, BAD_POLICY))

    def nacked() -> bool:
        sync = fleet.status()[B]["instances"][f"{B}-sync"]
        return sync["state"] == "nack" and "models.m.limits.rps" in (sync["error"] or "")

    fleet.wait(nacked, "spoke-b's syncer NACK in gateway hub status")
    assert fleet.held(B) == held
    assert answer(fleet.spokes[B], fleet.keys["good"]) == 200
    view = fleet.status()
    assert view[B]["instances"][f"{B}-sidecar"]["state"] == "ack"  # it never saw it
    assert view[A]["instances"][f"{A}-sync"]["state"] == "ack"

    # The entry removed, spoke-b is back on `*`, at the revision it holds: ACK again.
    put_on_feed(fleet, B, None)
    fleet.wait(lambda: fleet.status()[B]["instances"][f"{B}-sync"]["state"] == "ack",
               "spoke-b's syncer back to ACK")

    # An older revision on `*` (without the `good` key) is not applied by either spoke.
    older = policy_doc(fleet.keys)
    del older["keys"]["good"]
    put_on_feed(fleet, "*", feed.encode(1, older))
    for name in (A, B):
        fleet.wait(lambda n=name: syncer_line(fleet, n).get("feed_revision") == 1,
                   f"{name}'s syncer read the older revision")
    assert fleet.held(A) == fleet.held(B) == held
    assert all(answer(s, fleet.keys["good"]) == 200 for s in fleet.spokes.values())
    rev = fleet.publish(policy_doc(fleet.keys))  # the feed's `*` newest again
    fleet.wait(lambda: fleet.held(A) == fleet.held(B) == rev, "both on the next revision")


def test_hub_status_shows_both_spokes_and_their_instances_acked_and_fresh(
        fleet: Fleet) -> None:
    rev = fleet.held(A)

    def settled() -> bool:
        # The spool depth is sampled once a second, so an event of an earlier test still
        # on its way to Kafka can show as 1 for a beat: wait for it to drain, not past it.
        view = fleet.status()
        return all(i["revision"] == rev and i["spool_depth"] == 0
                   for s in (A, B) for i in view[s]["instances"].values())

    fleet.wait(settled, "every instance reports the newest revision and an empty spool")
    # Fresh: each instance reports again, with nothing new to say, after a moment a
    # heartbeat (1 s here) past the settling. (It was `age_s < 5` on one reading: beside
    # seven workers a heartbeat can come late, and a report just before the reading passed
    # it with no heartbeat at all.) An instance that stops heartbeating still fails.
    mark = time.time() + 1.0
    fleet.wait(lambda: _reported_since(fleet, mark), "every instance heartbeats after settling")
    view = fleet.status()
    assert set(view) == {A, B}
    for name in (A, B):
        assert view[name]["feed_revision"] == rev
        assert set(view[name]["instances"]) == {f"{name}-sidecar", f"{name}-sync"}
        for inst in view[name]["instances"].values():
            assert inst["state"] == "ack" and inst["error"] is None
            assert inst["limiter_store_up"] is True and inst["spool_depth"] == 0
            assert inst["age_s"] is not None
    # A line "in step" (not all SILENT: over 3 heartbeats), read until a heartbeat late
    # under load has come; an instance silent for good still fails.
    fleet.wait(lambda: f"spoke {A}: feed revision {rev}, in step" in fleet.hub("status").stdout,
               f"spoke {A} in step in the table")


def _reported_since(fleet: Fleet, mark: float) -> bool:
    """Every instance's last report was written after `mark` (wall clock, this host): the
    CLI's `now` is no earlier than the call's start, so at = now - age >= start - age."""
    start = time.time()
    view = fleet.status()
    return all(i["age_s"] is not None and start - i["age_s"] - 0.1 > mark  # age: 0.1 s steps
               for s in (A, B) for i in view[s]["instances"].values())


def test_kafka_cut_spokes_keep_serving_and_a_wiped_redis_comes_back_from_disk(
        fleet: Fleet) -> None:
    held = fleet.held(A)
    fleet.kafka.pause()  # SIGSTOP: the hub's Kafka hangs (no answer at all)
    try:
        for spoke in fleet.spokes.values():
            assert answer(spoke, fleet.keys["good"]) == 200
            codes = [answer(spoke, fleet.keys["rps1"]) for _ in range(3)]
            assert codes[0] == 200 and 429 in codes  # limits still enforced
        fleet.wait(lambda: syncer_line(fleet, A).get("feed") == "down",
                   "the syncer says the feed is down")
        assert metric(fleet.syncers[A], "gateway_hub_feed_up") == 0
        status = subprocess.run(
            [sys.executable, "-m", "gateway", "policy", "status", "--redis-url",
             fleet.spokes[A].redis_url], capture_output=True, text=True, timeout=30)
        assert "feed unreachable, retrying" in status.stdout, status.stdout

        # Redis wiped while the hub is away: the syncer puts the last good revision back,
        # and a sidecar started now serves it rather than denying everything.
        fleet.redis(A).flushall()
        fleet.wait(lambda: fleet.held(A) == held, "the last good revision restored")
        assert metric(fleet.syncers[A], 'gateway_hub_sync_revisions_total{result="restored"}') \
            == 1
        fleet.spokes[A]["sidecar"].restart()
        fleet.spokes[A].wait_ready(timeout=20)
        assert answer(fleet.spokes[A], fleet.keys["good"]) == 200
    finally:
        fleet.kafka.resume()

    doc, secret = with_key(fleet, "after_cut")
    rev = fleet.wait_value(lambda: fleet.publish(doc), "hub publish after the cut")
    fleet.wait(lambda: all(answer(s, secret) == 200 for s in fleet.spokes.values()),
               "a revision published after the cut served by both", timeout=30)
    assert fleet.held(A) == fleet.held(B) == rev
    fleet.wait(lambda: syncer_line(fleet, A).get("feed") == "up", "the feed back up")


def test_a_restarted_syncer_resumes_without_reapplying(fleet: Fleet) -> None:
    held, syncer = fleet.held(B), fleet.syncers[B]
    syncer.restart()
    fleet.wait(lambda: metric(syncer, "gateway_hub_feed_revision") == held
               and metric(syncer, "gateway_hub_feed_up") == 1, "the syncer caught up")
    assert metric(syncer, 'gateway_hub_sync_revisions_total{result="applied"}') is None
    assert metric(syncer, 'gateway_hub_sync_revisions_total{result="restored"}') is None
    # nor tried to (the compare-and-set would have refused it: a conflict)
    assert metric(syncer, 'gateway_hub_sync_errors_total{what="conflict"}') is None
    assert fleet.held(B) == held


def test_a_revision_a_sidecar_refuses_shows_as_its_nack(fleet: Fleet) -> None:
    """Written straight into spoke-b's Redis, past the syncer (as an older tool could): the
    sidecar keeps serving what it holds and tells the hub why. Last: it leaves spoke-b's
    Redis ahead of the feed."""
    from redis.asyncio import Redis

    from gateway.policy.store import PolicyStore

    held = fleet.held(B)

    async def write_raw() -> None:
        client = Redis.from_url(fleet.spokes[B].redis_url)
        await PolicyStore(client).publish_raw(held + 1, orjson.dumps(BAD_POLICY))
        await client.aclose()

    asyncio.run(write_raw())

    def nacked() -> bool:
        side = fleet.status()[B]["instances"][f"{B}-sidecar"]
        return side["state"] == "nack" and "models.m.limits.rps" in (side["error"] or "")

    fleet.wait(nacked, "spoke-b's sidecar NACK in gateway hub status")
    side = fleet.status()[B]["instances"][f"{B}-sidecar"]
    assert side["revision"] == held  # still serving the one it had
    assert answer(fleet.spokes[B], fleet.keys["good"]) == 200
    assert fleet.status()[A]["instances"][f"{A}-sidecar"]["state"] == "ack"


def test_a_spokes_redis_down_shows_in_hub_status_and_comes_back_from_disk(
        fleet: Fleet) -> None:
    """Its Redis stopped, both of spoke-b's instances tell the hub; restarted empty, it gets
    the last good revision back from the syncer's disk (not the one written past it)."""
    redis_b = fleet.spokes[B]["redis"]
    good = syncer_line(fleet, B)["feed_revision"]

    def store_up(want: bool) -> bool:
        instances = fleet.status()[B]["instances"].values()
        return all(i["limiter_store_up"] is want for i in instances)

    redis_b.stop()
    try:
        fleet.wait(lambda: store_up(False), "spoke-b's instances report the store down")
        assert all(i["limiter_store_up"] for i in fleet.status()[A]["instances"].values())
    finally:
        redis_b.start()
    fleet.wait(lambda: fleet.held(B) == good, "the last good revision restored")
    fleet.wait(lambda: store_up(True), "spoke-b's instances report the store up")
    assert answer(fleet.spokes[B], fleet.keys["good"]) == 200
