"""The hub's topics are created with settings a managed Kafka may refuse: the topic is then
made compacted with the broker's own sizes, not left to be auto-created plain."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.hub import topics


class _CappingAdmin:
    """A broker that refuses max.message.bytes over 8 MiB (as managed Kafkas cap it)."""

    made: list[dict[str, str]] = []

    def __init__(self, **_: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def create_topics(self, new: list[Any]) -> Any:
        configs = new[0].topic_configs
        if int(configs.get("max.message.bytes", 0)) > 8 << 20:
            return SimpleNamespace(topic_errors=[(new[0].name, 40, "max.message.bytes")])
        _CappingAdmin.made.append(dict(configs))
        return SimpleNamespace(topic_errors=[(new[0].name, 0, None)])


async def test_settings_a_broker_refuses_still_leave_the_topic_compacted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topics, "AIOKafkaAdminClient", _CappingAdmin)
    _CappingAdmin.made = []
    assert await topics.ensure_compacted("k:9092", topics.POLICY_TOPIC,
                                         topics.RECORD_MAX_BYTES) is True
    assert _CappingAdmin.made == [{"cleanup.policy": "compact"}]
    assert await topics.ensure_compacted("k:9092", topics.STATUS_TOPIC) is True
    assert _CappingAdmin.made[1] == {"cleanup.policy": "compact",
                                     "segment.ms": str(topics.SEGMENT_MS)}
