"""Both Redis clients under a real Sentinel set (primary, replica, three Sentinels): they
find the primary, follow a failover without a restart, and never write to a replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devspoke.procs import Service, free_port, redis_service
from devspoke.sentinels import primary_port, sentinel_set, sentinel_url, wait_sentinels
from gateway.cli import main as gateway
from gateway.limits.resp import RedisGone, RedisReplyError, RespClient
from gateway.policy.store import POLICY_KEY, PolicyStore
from gateway.redis_clients import limiter_client, policy_client, sync_client


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[dict[str, Service]]:
    services = sentinel_set(tmp_path)
    try:
        for svc in services.values():
            svc.start()
        wait_sentinels(services)
        yield services
    finally:
        for svc in reversed(services.values()):
            svc.stop()


async def _until(what: str, cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:g}s: {what}")
        await asyncio.sleep(0.1)


async def test_both_clients_find_the_primary_and_follow_a_failover(
        sentinels: dict[str, Service]) -> None:
    url = sentinel_url(sentinels)
    lean = limiter_client(url, 0.25)
    store = PolicyStore(policy_client(url, 0.25))
    await lean.call("SET", "before", "1")
    assert lean.primary == ("127.0.0.1", sentinels["redis"].port)
    assert await store.redis.get("before") == b"1"
    old = sentinels["redis"]
    with redis.Redis(port=sentinels["sentinel-0"].port) as s:
        s.execute_command("SENTINEL", "FAILOVER", "spoke")  # no kill: a clean switch-over
    new = sentinels["redis-replica"].port

    async def lean_on_new() -> bool:
        try:
            await lean.follow()
            await lean.call("SET", "after", "2")
        except (RedisGone, RedisReplyError):
            return False
        return lean.primary == ("127.0.0.1", new)

    await _until("the lean client writes to the promoted replica", lean_on_new)

    # redis-py asks the Sentinels only on connect, and takes a primary from SENTINEL MASTERS
    # (which names the new one once the failover is complete, after the lean client moved):
    # the policy store asks again on every refresh (follow_primary) and then leaves.
    async def store_follows() -> bool:
        await store.follow_primary()
        return store.redis.connection_pool.master_address == ("127.0.0.1", new)

    await _until("redis-py's Sentinel pool names the promoted replica", store_follows)
    await store.redis.set("after-store", "3")  # on the new primary, not the old
    assert primary_port(sentinels) == new
    with redis.Redis(port=new) as r:
        assert r.mget("after", "after-store") == [b"2", b"3"]
    with redis.Redis(port=old.port) as r:  # the demoted one took none of them itself
        assert r.info("errorstats").get("errorstat_READONLY") is None
    await lean.close()
    await store.redis.aclose()


async def test_a_primary_demoted_under_the_lean_client_is_left(tmp_path: Path) -> None:
    """READONLY (a primary turned replica, no disconnect) fails that call, runs nothing, and
    drops the connection; a URL naming a replica is refused at connect (ROLE)."""
    a = redis_service(free_port(), tmp_path).start()
    b = redis_service(free_port(), tmp_path).start()
    try:
        client = RespClient(f"redis://{a.address}/0")
        await client.call("SET", "k", "1")
        with redis.Redis(port=a.port) as r:
            r.replicaof("127.0.0.1", b.port)
        with pytest.raises(RedisReplyError, match="READONLY"):
            await client.call("SET", "k", "2")
        assert client._conn is not None and client._conn.lost is not None  # dropped
        await client.close()
    finally:
        a.stop()
        b.stop()


async def test_no_sentinel_answering_is_a_clear_redis_gone() -> None:
    dead = f"127.0.0.1:{free_port()}"
    client = RespClient(f"redis+sentinel://{dead}/spoke/0", connect_timeout=0.3)
    with pytest.raises(RedisGone, match=r"no Sentinel names a primary for 'spoke'.*"
                                       + dead.replace(".", r"\.")):
        await client.call("PING")


async def test_a_dead_sentinel_is_skipped_and_the_answering_one_asked_first(
        sentinels: dict[str, Service]) -> None:
    dead = ("127.0.0.1", free_port())
    url = sentinel_url(sentinels).replace("://", f"://{dead[0]}:{dead[1]},", 1)
    client = RespClient(url, connect_timeout=0.3)
    assert await client.call("PING") == b"PONG"
    assert client.primary == ("127.0.0.1", sentinels["redis"].port)
    assert client._order[0] == ("127.0.0.1", sentinels["sentinel-0"].port)  # asked first now
    await client.close()


def test_sync_client_reaches_the_primary(sentinels: dict[str, Service]) -> None:
    with sync_client(sentinel_url(sentinels, db=2)) as r:
        r.set("x", "y")
    with redis.Redis(port=sentinels["redis"].port, db=2) as r:
        assert r.get("x") == b"y"


def test_cli_applies_and_reads_policy_through_the_sentinels(
        sentinels: dict[str, Service], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = sentinel_url(sentinels)
    doc = tmp_path / "p.yaml"
    doc.write_text("models:\n  m: {}\n")
    assert gateway(["policy", "apply", str(doc), "--redis-url", url]) == 0
    assert gateway(["policy", "status", "--redis-url", url]) == 0
    assert "current revision: 1" in capsys.readouterr().out
    with redis.Redis(port=sentinels["redis"].port) as r:  # stored on the primary
        assert r.hget(POLICY_KEY, "revision") == b"1"


def test_a_bad_redis_url_is_a_clear_cli_error() -> None:
    with pytest.raises(SystemExit) as err:
        gateway(["policy", "status", "--redis-url", "redis+sentinel://u:secret@h:1"])
    assert "names no service" in str(err.value.code) and "secret" not in str(err.value.code)
    with pytest.raises(SystemExit) as err:
        gateway(["policy", "status", "--redis-url", "http://h:1"])
    assert "redis+sentinel://" in str(err.value.code)
