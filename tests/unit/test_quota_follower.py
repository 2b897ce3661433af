"""The allowance follower's handling of one message (gateway/hub/allowances.py) and the
quota topic's keys, without Kafka: the in-process limiter is the store."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from gateway.errors import StoreUnavailable
from gateway.hub import quota_topic as qt
from gateway.hub.allowances import AllowanceFollower, FollowerState, export
from gateway.limits.memory import MemoryLimiter
from gateway.log import configure
from gateway.policy_commands import allowances_text

DAY = "20270115"


def message(gen: int, allowance: Any, period: str = "day") -> dict[str, Any]:
    return {"kind": "allowance", "spoke": "east", "generation": gen, "allowances": [
        {"scope": "team:g", "period": period, "period_id": DAY, "quota": 1000,
         "allowance": allowance, "bound": allowance}]}


async def test_a_message_is_applied_and_reported_once_newer() -> None:
    store = MemoryLimiter()
    f = AllowanceFollower("unused:9092", "east", store=store)
    report = await f.take(message(3, 400))
    assert report == {"kind": "applied", "spoke": "east", "generation": 3, "applied": [
        {"scope": "team:g", "period": "day", "period_id": DAY, "allowance": 400, "used": 0}]}
    assert store.allowances == {f"tpd:team:g:{DAY}": 400} and f.state.generation == 3
    assert await f.take(message(2, 900)) is None  # older: nothing written
    assert store.allowances == {f"tpd:team:g:{DAY}": 400}
    assert (await f.take(message(3, 400)) or {})["generation"] == 3  # the same: reported again


async def test_an_unreadable_message_writes_nothing() -> None:
    store = MemoryLimiter()
    f = AllowanceFollower("unused:9092", "east", store=store)
    for bad in (message(1, "lots"), message(1, -5), message(1, 10, period="week"),
                {"generation": 1}, {"allowances": []}):
        assert await f.take(bad) is None
    assert store.allowances == {} and store.allowance_gen == 0


def test_quota_topic_keys() -> None:
    assert qt.parse_key(qt.allowance_key("east")) == ("allowance", "east")
    assert qt.parse_key(qt.applied_key("east")) == ("applied", "east")
    assert qt.parse_key(b"east/other") is None and qt.parse_key(None) is None
    assert qt.decode(b"not json") is None and qt.decode(b"[1]") is None
    assert qt.decode(None) is None and qt.decode(b'{"a": 1}') == {"a": 1}


def gauges() -> dict[str, float | None]:
    return {name: REGISTRY.get_sample_value(f"gateway_quota_{name}") for name in (
        "feed_up", "store_up", "allowance_generation", "allowance_applied_timestamp_seconds")}


async def test_the_followers_state_is_on_metrics_from_the_start_and_as_it_applies() -> None:
    f = AllowanceFollower("unused:9092", "east", store=MemoryLimiter())
    assert gauges() == {"feed_up": 0, "store_up": 1, "allowance_generation": 0,
                        "allowance_applied_timestamp_seconds": 0}
    await f.take(message(7, 400))
    assert f.state.applied_at > 0
    assert gauges() == {"feed_up": 0, "store_up": 1, "allowance_generation": 7,
                        "allowance_applied_timestamp_seconds": f.state.applied_at}
    export(FollowerState(generation=7, kafka_up=True, store_up=False, applied_at=5.0))
    assert gauges() == {"feed_up": 1, "store_up": 0, "allowance_generation": 7,
                        "allowance_applied_timestamp_seconds": 5.0}


class _Away(MemoryLimiter):
    """The in-process store, made to fail like a Redis that went away while `away`."""

    away = False

    async def allowance_generation(self) -> int:
        if self.away:
            raise StoreUnavailable("redis: connection refused")
        return await super().allowance_generation()


async def test_the_store_probe_says_when_redis_goes_away_between_allowances(
        capsys: pytest.CaptureFixture[str]) -> None:
    store = _Away()
    f = AllowanceFollower("unused:9092", "east", store=store)
    await f.take(message(2, 400))
    store.away = True
    # Read from stderr, where the services log: structlog's capture_logs misses a logger
    # that a command run earlier in this worker configured with caching (policy sync did).
    configure("info", cache=False)
    capsys.readouterr()
    await f.probe_store()  # no allowance is written meanwhile: only the probe can tell
    await f.probe_store()
    assert not f.state.store_up and f.state.error.startswith("store: ")
    events = [orjson.loads(line)["event"] for line in capsys.readouterr().err.splitlines()]
    assert events.count("quota_follower_retrying") == 1, events  # once per outage
    assert gauges()["store_up"] == 0
    store.away = False
    await f.probe_store()
    assert f.state.store_up and f.state.error == "" and gauges()["store_up"] == 1
    assert f.state.generation == 2  # what it applied stands


def test_the_followers_line_in_policy_status() -> None:
    def text(**state: Any) -> str:
        return allowances_text(asdict(FollowerState(**state)), now=1000.0)

    assert text(kafka_up=True) == "allowances: none yet"
    assert text() == "allowances: none yet; kafka away, retrying"  # not yet answered
    assert text(generation=4, kafka_up=True, applied_at=988.4) == \
        "allowances: generation 4, 12s ago"
    assert text(generation=4, applied_at=900.0, error="kafka: KafkaConnectionError()") == \
        "allowances: generation 4, 100s ago; kafka away, retrying: KafkaConnectionError()"
    assert text(kafka_up=True, store_up=False, error="store: StoreUnavailable('x')") == \
        "allowances: none yet; redis away, retrying: StoreUnavailable('x')"
    assert text(store_up=False, error="store: StoreUnavailable('x')") == (
        "allowances: none yet; kafka away, retrying; redis away, retrying: "
        "StoreUnavailable('x')")


async def test_a_quota_added_mid_day_counts_the_use_before_it_on_the_spoke() -> None:
    """A team used 1,000 tokens on a spoke this morning; a global limit of 1,000 a day is
    added at noon. The allocator counts the morning's use (its usage events), the spoke's
    counter for the global limit started at 0: every allowance, never below the use the
    allocator counts, left the spoke 1,000 tokens more to serve, round after round."""
    from gateway.hub.quota_ledger import QuotaLedger
    from gateway.limits.types import AdmitRequest, Admitted
    from gateway.policy.model import LimitSpec, TierLimit
    from gateway.usage_event import rfc3339

    now = 1_800_000_000.0
    ledger = QuotaLedger()
    ledger.on_applied("east", {"generation": 0, "applied": []})  # its follower's hello
    store = MemoryLimiter()
    f = AllowanceFollower("unused:9092", "east", store=store)
    team = TierLimit("team", "g", LimitSpec(global_tokens_per_day=1000))

    def event(eid: str, tokens: int) -> dict[str, Any]:
        return {"event_id": eid, "spoke": "east", "team": "g", "key_id": "k",
                "usage": {"total_tokens": str(tokens)}, "started_at": rfc3339(now)}

    ledger.on_usage(event("morning", 1000))  # no global limit yet
    ledger.on_policy("*", {"revision": 1, "policy": {
        "teams": {"g": {"models": ["*"], "global_limits": {"tokens_per_day": 1000}}}}})
    served = 0
    for r in range(3):
        msg = ledger.next_round(now + r).get("east")
        if msg is not None:
            report = await f.take(msg)
            assert report is not None
            ledger.on_applied("east", report)
        n = 0
        while isinstance(await store.admit(AdmitRequest(f"r{r}-{n}", (team,), 100, now + r)),
                         Admitted):
            await store.settle(f"r{r}-{n}", 100)
            n += 1
        served += n * 100
        ledger.on_usage(event(f"round{r}", n * 100))
    assert served == 0
