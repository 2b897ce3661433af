"""Token weights at the store, both stores alike (as tests/integration/test_limiter_contract.py):
a weighted model's settlement and its orphan's checkpoint charge the token windows the
weighted count, the orphan keeping its raw tokens for its event; a model without weights
stores and bills its checkpoint exactly as before."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Admitted, Limiter
from gateway.metering import billing, handoff
from gateway.metering.facts import ResponseFacts
from gateway.policy.model import LimitSpec, TierLimit
from gateway.token_weights import TokenWeights, limit_tokens
from gateway.usage_event import Usage

SLACK = 5.0
T0 = 1_800_000_000.0
W = TokenWeights(input=1, cached_input=0.1, cache_creation=1.25, output=4)
META = '["wk","t","m","/v1/chat/completions",true]'
USED = Usage(100, 7, 107, 40, 0, 8)  # 52 uncached + 0.1 x 40 + 1.25 x 8 + 4 x 7 = 94


@pytest.fixture(params=["memory", "redis"])
async def limiter(request: pytest.FixtureRequest) -> AsyncIterator[Limiter]:
    if request.param == "memory":
        yield MemoryLimiter(lease_ttl=60)
        return
    lim = RedisLimiter(RespClient(request.getfixturevalue("redis_url")), lease_ttl=60,
                       deadline=SLACK)
    yield lim
    await lim.close()


def _tier(name: str) -> TierLimit:
    return TierLimit("key", name, LimitSpec(concurrency=4, tokens_per_day=1000))


def _facts(weights: TokenWeights | None) -> handoff.RequestFacts:
    md = {**handoff.allowed("x", 500, 100),
          **handoff.caller("wk", "t", "m", "/v1/chat/completions", True, True, True, True,
                           False, weights=weights)}
    return handoff.read(orjson.loads(orjson.dumps(md)))


async def _left(lim: Limiter, name: str, now: float) -> int:
    """What is left of the day's 1000, as admission reads the counters."""
    return 1000 - int((await lim.counters(f"key:{name}", now)).day)


async def test_a_weighted_settlement_charges_the_weighted_count(limiter: Limiter) -> None:
    key = _tier("ws")
    reserve = W.reserve(100, 50)  # 125 + 200
    assert isinstance(await limiter.admit(AdmitRequest("w", (key,), reserve, T0, meta=META)),
                      Admitted)
    assert await _left(limiter, "ws", T0 + 1) == 1000 - 325
    await limiter.settle("w", limit_tokens(USED, _facts(W).weights))
    assert await _left(limiter, "ws", T0 + 2) == 1000 - 94


async def test_a_weighted_orphan_is_charged_its_weighted_checkpoint(limiter: Limiter) -> None:
    key = _tier("wo")
    assert isinstance(await limiter.admit(AdmitRequest("wo1", (key,), 600, T0, meta=META)),
                      Admitted)
    ck = billing.checkpoint(_facts(W), ResponseFacts(status=200, usage=USED))
    assert ck == (100, 7, 94, 40, 8)  # and the prompt's cache counts, for its event
    await limiter.renew(["wo1"], T0 + 10, {"wo1": ck})
    [orphan] = await limiter.sweep(T0 + 91)
    # the counters are charged 94; the event bills the raw tokens
    assert (orphan.request_id, orphan.charged, orphan.checkpoint) == ("wo1", 94, (100, 7))
    assert orphan.cache == (40, 8)
    b = billing.orphaned(handoff.orphan_facts(orphan.request_id, orphan.meta),
                         orphan.checkpoint, orphan.charged, orphan.cache)
    assert (b.usage.prompt_tokens, b.usage.completion_tokens, b.usage.total_tokens) == (
        100, 7, 107)
    # with its cache counts: the event counts (hub ledger, re-settlement) what was charged
    assert (b.usage.cached_tokens, b.usage.cache_creation_tokens) == (40, 8)
    assert limit_tokens(b.usage, W) == orphan.charged
    assert await _left(limiter, "wo", T0 + 92) == 1000 - 94


async def test_an_unweighted_orphan_is_charged_as_before(limiter: Limiter) -> None:
    key = _tier("uo")
    assert isinstance(await limiter.admit(AdmitRequest("uo1", (key,), 600, T0, meta=META)),
                      Admitted)
    ck = billing.checkpoint(_facts(None), ResponseFacts(status=200, usage=USED))
    assert ck == (100, 7)
    await limiter.renew(["uo1"], T0 + 10, {"uo1": ck})
    [orphan] = await limiter.sweep(T0 + 91)
    assert (orphan.charged, orphan.checkpoint) == (107, (100, 7))
    assert await _left(limiter, "uo", T0 + 92) == 1000 - 107


async def test_the_stored_checkpoint_is_byte_identical_without_weights(redis_url: str) -> None:
    """What renew.lua stores: "prompt:completion" as before, a third field only weighted
    (the format every sidecar's sweep reads), and the prompt's cached and cache-creation
    tokens in a field of their own, `k`, for a weighted model ("0:0" when it has none)."""
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK)
    r = aioredis.Redis.from_url(redis_url)
    try:
        for rid, weights, used, stored, cache in (
                ("ck-plain", None, USED, b"100:7", None),
                ("ck-weighted", W, Usage(100, 7, 107), b"100:7:128", b"0:0"),
                ("ck-cached", W, USED, b"100:7:94", b"40:8")):
            assert isinstance(await lim.admit(AdmitRequest(rid, (_tier(rid),), 600, T0,
                                                           meta=META)), Admitted)
            ck = billing.checkpoint(_facts(weights), ResponseFacts(status=200, usage=used))
            assert ck is not None
            await lim.renew([rid], T0 + 10, {rid: ck})
            assert await r.hget(f"gw:req:{rid}", "u") == stored
            assert await r.hget(f"gw:req:{rid}", "k") == cache
            await lim.settle(rid, 0)
    finally:
        await r.aclose()
        await lim.close()
