"""A burst of `n` > 1 chat requests, admitted through the Redis limiter (real Redis, the
session's server): each reserves all n completions, so the burst cannot overshoot a token
budget by n times (DESIGN §5)."""

from __future__ import annotations

import redis

from gateway.authz.decision import Allow, Deny
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from tests.unit.test_authz_engine import Gate, policy

BUDGET = 20_000


async def test_a_burst_of_n_4_requests_reserves_every_completion(redis_url: str) -> None:
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=30, deadline=5.0)
    db = redis.Redis.from_url(redis_url)
    try:
        gate = Gate(policy(key_limits=f"{{tokens_per_minute: {BUDGET}}}"), limiter=lim)
        body = {"model": "llama-3", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2000, "n": 4}
        decisions = [await gate.check(body) for _ in range(3)]
        allowed = [d for d in decisions if isinstance(d, Allow)]
        # 4 x 2,000 completion tokens each: two fit in 20,000, the third would not
        assert len(allowed) == 2, decisions
        assert all(d.context.reserved - d.context.prompt_estimate == 8000 for d in allowed)
        refused = decisions[2]
        assert isinstance(refused, Deny) and refused.status == 429, refused
        counted = sum(int(db.get(k) or 0) for k in db.keys("gw:tpm:key:*"))
        assert counted == sum(d.context.reserved for d in allowed)
    finally:
        await lim.close()
