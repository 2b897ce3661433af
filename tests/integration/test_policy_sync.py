"""Policy distribution on a real Redis: revisions, announcements, ACK/NACK, healing."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest
from redis.asyncio import Redis

import gateway.tasks
from gateway.policy.holder import PolicyHolder, RedisPolicySync
from gateway.policy.loader import parse_doc
from gateway.policy.store import PolicyStore, RevisionConflict

GOOD = b"models: {m: {}}\nteams: {t: {models: ['*']}}\n"


async def _wait(cond: object, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_ack_then_nack_keeps_previous_revision(redis_url: str) -> None:
    store = PolicyStore(Redis.from_url(redis_url))
    holder = PolicyHolder()
    sync = RedisPolicySync(holder, store, "inst-1", recheck=60)
    sync.start()
    try:
        rev = await store.publish(parse_doc(GOOD))
        await _wait(lambda: holder.policy is not None and holder.policy.revision == rev)
        await asyncio.sleep(0.05)
        status = (await store.statuses())["inst-1"]
        assert status["state"] == "ACK" and status["revision"] == rev

        # A corrupt revision, as a buggy hub could write it straight into Redis.
        bad = orjson.dumps({"models": {"m": {"limits": {"rps": -3, "bogus": 1}}}})
        await store.publish_raw(rev + 1, bad)
        await _wait(lambda: (rev + 1) in holder.rejected)
        assert holder.policy is not None and holder.policy.revision == rev  # old one serves
        await asyncio.sleep(0.05)
        status = (await store.statuses())["inst-1"]
        assert status["state"] == "NACK" and status["revision"] == rev
        assert status["latest"] == rev + 1
        assert "models.m.limits.rps" in status["error"]

        # The next valid revision is accepted and ACKed again.
        rev3 = await store.publish(parse_doc(GOOD))
        await _wait(lambda: holder.policy is not None and holder.policy.revision == rev3)
        await asyncio.sleep(0.05)
        assert (await store.statuses())["inst-1"]["state"] == "ACK"
    finally:
        await sync.stop()


async def test_missed_announcement_heals_on_recheck(redis_url: str) -> None:
    store = PolicyStore(Redis.from_url(redis_url))
    holder = PolicyHolder()
    sync = RedisPolicySync(holder, store, "inst-2", recheck=0.1)
    sync._tasks = [asyncio.create_task(sync._poll())]  # polling only: no pub/sub listener
    try:
        rev = await store.publish(parse_doc(GOOD))
        await _wait(lambda: holder.policy is not None and holder.policy.revision == rev)
    finally:
        await sync.stop()


async def test_publish_rejects_stale_or_conflicting_revisions(redis_url: str) -> None:
    store = PolicyStore(Redis.from_url(redis_url))
    r1 = await store.publish(parse_doc(GOOD))
    doc = parse_doc(GOOD + b"revision: 1\n")
    with pytest.raises(RevisionConflict, match="not newer"):
        await store.publish(doc)
    with pytest.raises(RevisionConflict, match="moved"):
        await store.publish(parse_doc(GOOD), expect=r1 - 1)


async def test_stop_ends_the_sync_whenever_it_is_stopped(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py can swallow a cancellation that lands inside a command: stop() then hung
    (a SIGTERMed sidecar that never exits). Stopped at random moments of its Redis calls,
    it ends every time. (Cancelled again every 5 ms, not 50: most of the 150 stops need a
    second cancel or more, which at 50 ms took 14 s.)"""
    monkeypatch.setattr(gateway.tasks, "RETRY_S", 0.005)
    store = PolicyStore(Redis.from_url(redis_url))
    await store.publish(parse_doc(GOOD))
    for i in range(150):
        sync = RedisPolicySync(PolicyHolder(), store, f"inst-stop-{i}", recheck=0.0005)
        sync._tasks = [asyncio.create_task(sync._poll())]  # Redis calls back to back
        await asyncio.sleep(random.random() * 0.005)
        await asyncio.wait_for(sync.stop(), 5)


async def test_a_feed_revision_past_doubles_is_nacked_and_never_reaches_redis(
        redis_url: str, tmp_path) -> None:
    """A foreign hub numbering revisions by time.time_ns(): Redis's Lua (doubles) stored
    1733456789012345678 as '1.7334567890123457e+18', which no reader can take back as an
    integer, so the syncer's every round raised ValueError (`policy sync` died, and again
    on each restart). Above 2**53 - 1, JSON's safe integers, a revision is refused."""
    from gateway.hub import feed
    from gateway.hub.sync import Syncer
    client = Redis.from_url(redis_url)
    store = PolicyStore(client)
    syncer = Syncer("s1", "sync-t", store, "127.0.0.1:1", tmp_path, idempotence=False)
    doc = orjson.loads(orjson.dumps(parse_doc(GOOD + b"keys: {k: {team: t, sha256: '"
                                              + b"0" * 64 + b"'}}\n").model_dump(
        exclude_none=True, exclude_defaults=True)))
    syncer.current = {"*": feed.encode(2, doc)}
    await syncer.sync_once()
    assert await store.current_revision() == 2
    for big in (1733456789012345678, 2**53):
        syncer.current = {"*": feed.encode(big, doc)}
        await syncer.sync_once()
        await syncer.sync_once()  # the round after: Redis still readable
        assert await store.current_revision() == 2
        assert syncer.status().state == "nack" and "2**53" in (syncer.status().error or "")
    syncer.current = {"*": feed.encode(2**53 - 1, doc)}
    await syncer.sync_once()
    assert await store.current_revision() == 2**53 - 1 and syncer.status().state == "ack"
    await client.aclose()


async def test_a_round_that_fails_unexpectedly_does_not_end_the_syncer(
        redis_url: str, tmp_path) -> None:
    """A revision in the spoke's Redis that is not an integer (written by hand, or by an
    older tool): every round raised ValueError out of the syncer's tasks, which ended
    `gateway policy sync` (and again after each restart). It is logged, counted, and the
    next round, once Redis is readable again, brings the feed's revision."""
    from gateway.hub import feed
    from gateway.hub.sync import Syncer
    client = Redis.from_url(redis_url)
    store = PolicyStore(client)
    syncer = Syncer("s1", "sync-t", store, "127.0.0.1:1", tmp_path, idempotence=False)
    doc = {"models": {"m": {}}, "teams": {"t": {"models": ["*"]}},
           "keys": {"k": {"team": "t", "sha256": "0" * 64}}}
    syncer.current = {"*": feed.encode(3, doc)}
    await client.hset("gw:policy", mapping={"revision": "three", "doc": "{}"})
    await syncer._round()  # raised ValueError
    assert await client.hget("gw:policy", "revision") == b"three"
    await client.delete("gw:policy")
    await syncer._round()
    assert await store.current_revision() == 3
    await client.aclose()
