"""`limiter_store_unreachable` carries how the store failed its probe (`error`): the
clients' 503s say only that it cannot be reached, on the word that the log says how.
RedisLimiter.ping swallows the connection's error into False, so the probe must ask the
store for its failure, not read a bare False as "the ping was refused"."""

from __future__ import annotations

import socket

from gateway import redis_clients
from gateway.limits.ahead import AheadLimiter
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis_store import RedisLimiter
from gateway.server.app import App
from gateway.settings import Settings


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_unreachable_redis_is_logged_with_its_error() -> None:
    port = _closed_port()  # nothing listens there: the connect is refused
    limiter = RedisLimiter(redis_clients.limiter_client(f"redis://127.0.0.1:{port}/0", 0.25))
    app = App(Settings(), "test", limiter=limiter)
    try:
        up, why = await app._store_answers()
        assert not up
        assert why != "the ping was refused"
        assert str(port) in why, why  # the connection's own error, naming the address
        assert await limiter.ping() is False  # readyz's question: still a bool
        # behind admit-ahead, the same
        app.limiter = AheadLimiter(limiter, 0.25)
        up, why = await app._store_answers()
        assert not up and str(port) in why, why
    finally:
        await limiter.close()


async def test_a_store_that_answers_has_no_error() -> None:
    app = App(Settings(), "test", limiter=MemoryLimiter())
    assert await app._store_answers() == (True, "")
