"""The allowance follower's handling of one message (gateway/hub/allowances.py) and the
quota topic's keys, without Kafka: the in-process limiter is the store."""

from __future__ import annotations

from typing import Any

from gateway.hub import quota_topic as qt
from gateway.hub.allowances import AllowanceFollower
from gateway.limits.memory import MemoryLimiter

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
