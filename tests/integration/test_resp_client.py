"""The limiter's Redis client against a real Redis: pipelining, errors, scripts, outages."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio
import trustme

from devspoke.procs import Service, free_port, redis_service
from gateway.limits.resp import RedisGone, RedisReplyError, RespClient, Script, tls_context


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[Service]:
    """A Redis this test may kill, pause and restart."""
    svc = redis_service(free_port(), tmp_path).start()
    yield svc
    svc.stop()


async def test_concurrent_calls_pipeline_on_one_connection(redis_url: str) -> None:
    client = RespClient(redis_url)
    replies = await asyncio.gather(*(client.call("ECHO", f"m{i}") for i in range(500)))
    assert replies == [f"m{i}".encode() for i in range(500)]
    clients = await client.call("CLIENT", "LIST")
    assert clients.count(b"cmd=client") == 1  # one connection carried all of them
    await client.close()


async def test_an_error_reply_fails_only_its_own_call(redis_url: str) -> None:
    client = RespClient(redis_url)
    await client.call("SET", "s", "text")
    ok1, bad, ok2 = await asyncio.gather(
        client.call("GET", "s"), client.call("INCR", "s"), client.call("ECHO", "after"),
        return_exceptions=True)
    assert ok1 == b"text" and ok2 == b"after"
    assert isinstance(bad, RedisReplyError) and "not an integer" in str(bad)
    await client.close()


async def test_url_selects_the_database(redis_url: str) -> None:
    db3 = RespClient(redis_url.rsplit("/", 1)[0] + "/3")
    await db3.call("SET", "where", "three")
    db0 = RespClient(redis_url)
    assert await db0.call("GET", "where") is None
    assert await db3.call("GET", "where") == b"three"
    await db0.close()
    await db3.close()


def test_unsupported_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="scheme"):
        RespClient("http://127.0.0.1:6379")


async def test_scripts_reload_after_a_script_flush(redis_url: str) -> None:
    client = RespClient(redis_url)
    script = Script(client, "return tonumber(ARGV[1]) + 1")
    assert await script(41) == 42
    await client.call("SCRIPT", "FLUSH")
    assert await script(1) == 2  # NOSCRIPT → EVAL, which caches it again
    assert await client.call("SCRIPT", "EXISTS", script.sha) == [1]
    await client.close()


async def test_killed_redis_fails_calls_then_reconnects_after_restart(
        own_redis: Service) -> None:
    client = RespClient(f"redis://{own_redis.address}/0", timeout=1.0, connect_timeout=0.5)
    assert await client.call("PING") == b"PONG"
    own_redis.kill()
    with pytest.raises(RedisGone):
        await client.call("PING")
    with pytest.raises(RedisGone, match="cannot connect"):
        await client.call("PING")
    own_redis.start()
    assert await client.call("PING") == b"PONG"
    await client.close()


async def test_a_stalled_redis_times_out_every_waiting_call(own_redis: Service) -> None:
    client = RespClient(f"redis://{own_redis.address}/0", timeout=0.3)
    assert await client.call("PING") == b"PONG"
    own_redis.pause()
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(*(client.call("PING") for _ in range(10)),
                                       return_exceptions=True)
        assert all(isinstance(r, RedisGone) for r in results), results
        # a call failed by another's wait (it reaches a client's 503) is told so
        assert "no reply within 0.3s to the oldest call" in str(results[-1]), results[-1]
        assert 0.25 < time.monotonic() - t0 < 2.0
    finally:
        own_redis.resume()
    assert await client.call("PING") == b"PONG"  # a new connection, replies in order again
    await client.close()


async def test_a_caller_that_gives_up_does_not_shift_later_replies(redis_url: str) -> None:
    client = RespClient(redis_url)
    slow = asyncio.ensure_future(client.call("BLPOP", "nothing-here", "0.2"))
    await asyncio.sleep(0.05)
    slow.cancel()
    assert await client.call("ECHO", "mine") == b"mine"
    await client.close()


async def test_password_database_and_unix_socket_come_from_the_url(tmp_path: Path) -> None:
    port, sock = free_port(), tmp_path / "redis.sock"
    base = redis_service(port, tmp_path)
    svc = Service("redis", [*base.argv, "--unixsocket", str(sock), "--requirepass", "pw"],
                  port, tmp_path).start()
    try:
        tcp = RespClient(f"redis://:pw@127.0.0.1:{port}/2")
        await tcp.call("SET", "k", "v")
        unix = RespClient(f"unix://:pw@{sock}?db=2")
        assert await unix.call("GET", "k") == b"v"  # same database, over the socket
        with pytest.raises(RedisReplyError, match="NOAUTH"):
            await RespClient(f"redis://127.0.0.1:{port}/0").call("GET", "k")
        with pytest.raises(RedisGone, match="WRONGPASS"):
            await RespClient(f"redis://:nope@127.0.0.1:{port}/0").call("GET", "k")
        for c in (tcp, unix):
            await c.close()
    finally:
        svc.stop()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[Service, Path]]:
    """A Redis that speaks TLS only, with a certificate for 127.0.0.1 from a throwaway CA."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_pem, cert_pem, key_pem = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    port = free_port()
    svc = redis_service(port, tmp_path)
    svc.argv[svc.argv.index("--port") + 1] = "0"  # no plaintext port at all
    svc.argv += ["--tls-port", str(port), "--tls-cert-file", str(cert_pem),
                 "--tls-key-file", str(key_pem), "--tls-ca-cert-file", str(ca_pem),
                 "--tls-auth-clients", "no"]
    svc.start()
    yield svc, ca_pem
    svc.stop()


async def test_rediss_speaks_tls_and_refuses_an_unknown_ca(
        tls_redis: tuple[Service, Path]) -> None:
    svc, ca_pem = tls_redis
    url = f"rediss://{svc.address}/0?ssl_ca_certs={ca_pem}"
    client = RespClient(url)
    assert await client.call("PING") == b"PONG"
    script = Script(client, "return redis.call('INCR', KEYS[1] or 'n')")
    assert await script() == 1
    await client.close()
    # The same URL serves redis-py (the policy store).
    store = redis.asyncio.Redis.from_url(url)
    assert await store.ping()
    await store.aclose()
    # The system's CAs do not know this one: no connection, never plaintext.
    untrusting = RespClient(f"rediss://{svc.address}/0", connect_timeout=2.0)
    with pytest.raises(RedisGone, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        await untrusting.call("PING")
    plaintext = RespClient(f"redis://{svc.address}/0", timeout=1.0)
    with pytest.raises(RedisGone):
        await plaintext.call("PING")
    await plaintext.close()


def test_rediss_options_are_checked() -> None:
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        RespClient("rediss://127.0.0.1:1/0?ssl_cert_reqs=maybe")
    ctx = tls_context("rediss://127.0.0.1:1/0?ssl_cert_reqs=none")
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname
    assert tls_context("redis://127.0.0.1:1/0") is None
