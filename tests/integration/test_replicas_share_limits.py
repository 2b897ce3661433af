"""Two sidecar replicas on one Redis are one limiter: a slot, a token reservation or a
request one replica admits is seen by the other at once. Peers keep these per replica
(LiteLLM #16011: an engine's concurrency multiplied by the replica count; Bifrost #3547:
per-replica caps). Each replica is its own RedisLimiter with its own connection, as two
pods would be; time is passed in, so nothing sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Admitted, Refused, Verdict
from gateway.policy.model import LimitSpec, TierLimit

T0 = 1_800_000_000.0
SLACK = 5.0  # the store's deadline, not under test here


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[tuple[RedisLimiter, RedisLimiter]]:
    a = RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK)
    b = RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK)
    yield a, b
    await a.close()
    await b.close()


async def admit(lim: RedisLimiter, rid: str, tier: TierLimit, reserve: int = 0,
                now: float = T0) -> Verdict:
    return await lim.admit(AdmitRequest(rid, (tier,), reserve, now))


def refused(v: Verdict, limit: str) -> bool:
    return isinstance(v, Refused) and v.limit == limit


async def test_a_concurrency_limit_holds_across_replicas(
        replicas: tuple[RedisLimiter, RedisLimiter]) -> None:
    a, b = replicas
    t = TierLimit("model", "m", LimitSpec(concurrency=2))
    assert isinstance(await admit(a, "r1", t), Admitted)
    assert isinstance(await admit(b, "r2", t), Admitted)
    # per replica there would be room for 2 more: together the limit is reached
    assert refused(await admit(a, "r3", t), "concurrency")
    assert refused(await admit(b, "r4", t), "concurrency")
    await a.settle("r1", None)  # a slot replica A held, freed: replica B may take it
    assert isinstance(await admit(b, "r5", t), Admitted)
    assert refused(await admit(a, "r6", t), "concurrency")


async def test_a_token_reservation_holds_across_replicas(
        replicas: tuple[RedisLimiter, RedisLimiter]) -> None:
    a, b = replicas
    t = TierLimit("key", "k", LimitSpec(tokens_per_minute=1000))
    assert isinstance(await admit(a, "r1", t, reserve=600), Admitted)
    assert refused(await admit(b, "r2", t, reserve=500), "tokens_per_minute")
    await a.settle("r1", 100)  # it used 100 of its 600: B now sees 900 left
    assert isinstance(await admit(b, "r3", t, reserve=500), Admitted)
    assert refused(await admit(a, "r4", t, reserve=500), "tokens_per_minute")


async def test_a_request_rate_holds_across_replicas(
        replicas: tuple[RedisLimiter, RedisLimiter]) -> None:
    a, b = replicas
    t = TierLimit("team", "t", LimitSpec(rps=2, burst=2))
    assert isinstance(await admit(a, "r1", t), Admitted)
    assert isinstance(await admit(b, "r2", t), Admitted)
    assert refused(await admit(a, "r3", t), "rps")
    assert refused(await admit(b, "r4", t), "rps")
    assert isinstance(await admit(b, "r5", t, now=T0 + 0.5), Admitted)  # one cell refilled
    assert refused(await admit(a, "r6", t, now=T0 + 0.5), "rps")
