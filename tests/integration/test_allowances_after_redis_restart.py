"""A spoke's allowances outlive a Redis restart that lost them (DESIGN §10): the follower
puts the last one applied back, without waiting for the allocator to change it (it
publishes only on change). Real Redis, restarted empty (no RDB, no AOF)."""

from __future__ import annotations

import asyncio

import redis

from devspoke.procs import Service
from gateway.hub.allowances import AllowanceFollower
from gateway.limits.allowances import RedisAllowances
from gateway.limits.resp import RespClient

DAY = "20270115"


async def test_allowances_lost_by_a_redis_restart_are_put_back(
        redis_url: str, redis_server: Service) -> None:
    f = AllowanceFollower("unused:9092", "east",
                          store=RedisAllowances(RespClient(redis_url)), retry_s=0.05)
    db = redis.Redis.from_url(redis_url)
    try:
        msg = {"kind": "allowance", "spoke": "east", "generation": 7, "allowances": [
            {"scope": "team:g", "period": "day", "period_id": DAY, "allowance": 400}]}
        assert await f.take(msg) is not None
        assert db.get(f"gw:allow:tpd:team:g:{DAY}") == b"400"
        redis_server.stop()
        redis_server.start()  # empty: admission would enforce the fallback share
        assert db.get(f"gw:allow:tpd:team:g:{DAY}") is None
        for _ in range(40):  # the follower's loop: probe, then apply (retried while down)
            await f.probe_store()
            await f._apply()
            if db.get(f"gw:allow:tpd:team:g:{DAY}") is not None:
                break
            await asyncio.sleep(0.05)
        assert db.get(f"gw:allow:tpd:team:g:{DAY}") == b"400"
        assert db.get("gw:allow:gen") == b"7" and f.state.store_up
    finally:
        db.close()
        await f.store.redis.close()  # type: ignore[attr-defined]
