"""The hub's topics are created with settings a managed Kafka may refuse: the topic is then
made compacted with the broker's own sizes, not left to be auto-created plain."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.hub import topics


class _Admin:
    """Stands in for aiokafka's admin client: connects to nothing."""

    def __init__(self, **_: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


class _CappingAdmin(_Admin):
    """A broker that refuses max.message.bytes over 8 MiB (as managed Kafkas cap it)."""

    made: list[dict[str, str]] = []

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


class _FewBrokersAdmin(_Admin):
    """A Kafka of `brokers` brokers: a replication factor above that is refused with
    INVALID_REPLICATION_FACTOR (38), as Apache Kafka does; every NewTopic asked is kept."""

    brokers = 1
    asked: list[Any] = []

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


class _RefusingAdmin(_Admin):
    """A broker that refuses every CreateTopics with `code` (INVALID_REPLICATION_FACTOR, a
    policy's, or an authorization error a managed Kafka gives even for a topic there), or
    creates the topic (`code` 0); `existing` is what its metadata lists (None: it fails)."""

    code = 38
    existing: list[str] | None = []
    created: list[str] = []
    listed = 0  # metadata requests for the topic list

    async def create_topics(self, new: list[Any]) -> Any:
        if self.code == 0:
            _RefusingAdmin.created.append(new[0].name)
        return SimpleNamespace(topic_errors=[(new[0].name, self.code, "refused" if self.code
                                              else None)])

    async def list_topics(self) -> list[str]:
        _RefusingAdmin.listed += 1
        if self.existing is None:
            from aiokafka.errors import KafkaConnectionError
            raise KafkaConnectionError("metadata: connection lost")
        return list(self.existing)


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """`hub publish` against _RefusingAdmin, its records kept in memory (no Kafka)."""
    monkeypatch.setattr(topics, "AIOKafkaAdminClient", _RefusingAdmin)
    _RefusingAdmin.existing, _RefusingAdmin.created, _RefusingAdmin.listed = [], [], 0
    written: dict[str, list[Any]] = {}

    async def produce(bootstrap: str, topic: str, key: str, value: bytes | None,
                      *, idempotence: bool = True) -> None:
        written.setdefault(topic, []).append((key, value))

    async def read_all(bootstrap: str, topic: str, timeout: float = 10.0) -> list[Any]:
        return list(written.get(topic, []))

    monkeypatch.setattr("gateway.hub.publish.produce", produce)
    monkeypatch.setattr("gateway.hub.publish.read_all", read_all)
    return written


def _policy(tmp_path: Any) -> str:
    doc = tmp_path / "p.yaml"
    doc.write_text("models: {m: {}}\nteams: {t: {models: ['*']}}\n"
                   "keys: {k: {team: t, sha256: '" + "0" * 64 + "'}}\n")
    return str(doc)


@pytest.mark.parametrize(("code", "name"), [(38, "INVALID_REPLICATION_FACTOR"),
                                            (44, "POLICY_VIOLATION"),
                                            (29, "TOPIC_AUTHORIZATION_FAILED")])
def test_hub_publish_writes_nothing_when_the_feed_is_refused_and_not_there(
        code: int, name: str, refusing: dict[str, list[Any]], tmp_path: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The broker refuses to create llm.policy.v1 and it does not exist: produced anyway, a
    broker that auto-creates topics made it plain, and the `*` revision went with its
    retention. Now exit 1 (an operational failure), nothing produced, and one line naming
    the topic, the broker's error and the fix."""
    from gateway.cli import main
    _RefusingAdmin.code = code
    assert main(["hub", "publish", _policy(tmp_path), "--bootstrap", "k:9092"]) == 1
    assert refusing == {}
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()  # 44: after the warning that the sizes were refused
    assert len(lines) == (2 if code == 44 else 1) and "topic_not_created" not in err, err
    line = lines[-1]
    assert line.startswith("error: nothing published: the broker refused to create "
                           f"{topics.POLICY_TOPIC} (error {code} {name}"), line
    assert "does not exist" in line and "cleanup.policy=compact" in line
    assert "GATEWAY_TOPIC_REPLICATION (now 1)" in line


def test_hub_publish_writes_nothing_when_whether_the_refused_feed_exists_is_unknown(
        refusing: dict[str, list[Any]], tmp_path: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused, then the metadata asked fails: not written on a guess. Exit 1."""
    from gateway.cli import main
    _RefusingAdmin.code, _RefusingAdmin.existing = 38, None
    assert main(["hub", "publish", _policy(tmp_path), "--bootstrap", "k:9092"]) == 1
    assert refusing == {}
    err = capsys.readouterr().err
    assert "could not be told" in err and "error 38 INVALID_REPLICATION_FACTOR" in err


@pytest.mark.parametrize("code", [29, 31, 38])
def test_hub_publish_goes_on_when_the_refused_feed_already_exists(
        code: int, refusing: dict[str, list[Any]], tmp_path: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An operator made llm.policy.v1; a managed Kafka answers the create with an
    authorization error (29, 31) or a factor it would not take (38) all the same: the topic
    is there, so the revision is published as before."""
    from gateway.cli import main
    _RefusingAdmin.code, _RefusingAdmin.existing = code, ["other", topics.POLICY_TOPIC]
    assert main(["hub", "publish", _policy(tmp_path), "--bootstrap", "k:9092"]) == 0
    assert capsys.readouterr().out == "published revision 1 for spoke *\n"
    assert [k for k, _ in refusing[topics.POLICY_TOPIC]] == ["*"]
    assert _RefusingAdmin.listed == 1


def test_hub_publish_asks_no_topic_list_when_the_feed_is_created(
        refusing: dict[str, list[Any]], tmp_path: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Created (or already there: 36): published as before, at no extra request."""
    from gateway.cli import main
    for code in (0, 36):
        _RefusingAdmin.code = code
        assert main(["hub", "publish", _policy(tmp_path), "--bootstrap", "k:9092"]) == 0
    assert capsys.readouterr().out == ("published revision 1 for spoke *\n"
                                       "published revision 2 for spoke *\n")
    assert _RefusingAdmin.created == [topics.POLICY_TOPIC]
    assert _RefusingAdmin.listed == 0


async def test_the_status_and_quota_topics_stay_best_effort_when_refused(
        refusing: dict[str, list[Any]]) -> None:
    """Only the feed is required: a refused status or quota topic is logged, not checked,
    and its writer goes on (True: not asked again)."""
    _RefusingAdmin.code = 38
    assert await topics.ensure_compacted("k:9092", topics.STATUS_TOPIC) is True
    await topics.CompactedTopic("k:9092", "llm.quota.v1").ensure()
    assert _RefusingAdmin.listed == 0
