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


class _FewBrokersAdmin:
    """A Kafka of `brokers` brokers: a replication factor above that is refused with
    INVALID_REPLICATION_FACTOR (38), as Apache Kafka does; every NewTopic asked is kept."""

    brokers = 1
    asked: list[Any] = []

    def __init__(self, **_: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def create_topics(self, new: list[Any]) -> Any:
        _FewBrokersAdmin.asked += new
        t = new[0]
        if t.replication_factor > self.brokers:
            return SimpleNamespace(topic_errors=[(
                t.name, 38, f"Replication factor: {t.replication_factor} larger than "
                            f"available brokers: {self.brokers}.")])
        return SimpleNamespace(topic_errors=[(t.name, 0, None)])


@pytest.fixture
def few_brokers(monkeypatch: pytest.MonkeyPatch) -> type[_FewBrokersAdmin]:
    monkeypatch.setattr(topics, "AIOKafkaAdminClient", _FewBrokersAdmin)
    _FewBrokersAdmin.asked = []
    _FewBrokersAdmin.brokers = 1
    return _FewBrokersAdmin


async def test_the_hub_topics_are_asked_with_the_replication_factor_given(
        few_brokers: type[_FewBrokersAdmin]) -> None:
    """GATEWAY_TOPIC_REPLICATION reaches the broker's CreateTopics from each writer that
    creates a hub topic; unset it is 1, as it always was (NewTopic(topic, 1, 1))."""
    from gateway.hub import quota_topic as qt
    from gateway.hub.status import StatusReporter
    few_brokers.brokers = 3
    assert await topics.ensure_compacted("k:9092", topics.POLICY_TOPIC) is True
    assert await topics.ensure_compacted("k:9092", topics.POLICY_TOPIC, topics.RECORD_MAX_BYTES,
                                         replication=3) is True
    await topics.CompactedTopic("k:9092", "t.compacted", replication=2).ensure()
    reporter = StatusReporter("k:9092", lambda: None, 10.0,  # type: ignore[arg-type,return-value]
                              replication=3)
    await reporter.topic.ensure()
    pub = qt.QuotaPublisher("k:9092", replication=3)
    await pub._topic.ensure()
    assert [(t.name, t.num_partitions, t.replication_factor) for t in few_brokers.asked] == [
        (topics.POLICY_TOPIC, 1, 1), (topics.POLICY_TOPIC, 1, 3), ("t.compacted", 1, 2),
        (topics.STATUS_TOPIC, 1, 3), (qt.QUOTA_TOPIC, 1, 3)]
    assert all(t.topic_configs["cleanup.policy"] == "compact" for t in few_brokers.asked)


async def test_a_replication_factor_the_broker_refuses_is_named_and_the_write_goes_on(
        few_brokers: type[_FewBrokersAdmin], capsys: pytest.CaptureFixture[str]) -> None:
    """A factor above the brokers (3 on one): the broker refuses the topic (38). One warning
    names the factor and GATEWAY_TOPIC_REPLICATION, and the writer goes on as after any
    refusal (best effort: the broker is not asked again, the report is sent)."""
    from gateway.hub.status import Status, StatusReporter, now_text
    from gateway.log import configure
    configure("info", cache=False)

    class _Producer:
        sent: list[Any] = []

        async def send_batch(self, batch: list[Any]) -> None:
            self.sent += batch

    reporter = StatusReporter("k:9092", lambda: Status("s1", "i1", 1, "ack", None, now_text(),
                                                       0, 0.0, True), 10.0, replication=3)
    reporter.producer = _Producer()  # type: ignore[assignment]
    await reporter.send_now()
    await reporter.send_now()
    assert reporter.sent == 2 and len(_Producer.sent) == 2  # written all the same
    assert [t.replication_factor for t in few_brokers.asked] == [3]  # asked once, not again
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "topic_not_created" in line]
    assert len(lines) == 1, err
    assert topics.STATUS_TOPIC in lines[0] and '"error_code": 38' in lines[0]
    assert "GATEWAY_TOPIC_REPLICATION" in lines[0] and "replication factor 3" in lines[0]


async def test_a_policy_refusing_even_compaction_alone_names_the_replication_setting(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A managed Kafka whose policy wants another factor answers POLICY_VIOLATION (44): asked
    again with compaction alone, it refuses again, and the warning names the setting."""
    from gateway.log import configure
    configure("info", cache=False)

    class _PolicyAdmin(_FewBrokersAdmin):
        async def create_topics(self, new: list[Any]) -> Any:
            _FewBrokersAdmin.asked += new
            return SimpleNamespace(topic_errors=[(new[0].name, 44, "replication factor: 3")])

    monkeypatch.setattr(topics, "AIOKafkaAdminClient", _PolicyAdmin)
    _FewBrokersAdmin.asked = []
    assert await topics.ensure_compacted("k:9092", topics.POLICY_TOPIC, replication=1) is True
    assert [t.replication_factor for t in _FewBrokersAdmin.asked] == [1, 1]
    err = capsys.readouterr().err
    assert "topic_settings_refused" in err
    line = next(ln for ln in err.splitlines() if "topic_not_created" in ln)
    assert '"error_code": 44' in line and "GATEWAY_TOPIC_REPLICATION" in line
