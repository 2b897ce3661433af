"""`hub unpublish` run again after a failure part way: a fake feed (a list of records), the
broker failing at a chosen produce."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import SinkUnavailable
from gateway.hub import feed
from gateway.hub import publish as publish_module
from gateway.hub.publish import PartlyUnpublished, Unpublished, unpublish

DOC = {"models": {"m": {}}, "teams": {"t": {"models": ["m"]}},
       "keys": {"k": {"team": "t", "sha256": "1" * 64}}}


@pytest.fixture
def topic(monkeypatch: pytest.MonkeyPatch) -> list[feed.Record]:
    records: list[feed.Record] = [("*", feed.encode(1, DOC)), ("a", feed.encode(2, DOC)),
                                  ("b", feed.encode(3, DOC))]

    async def read_all(bootstrap: str, topic: str, timeout: float = 10.0) -> list[Any]:
        return list(records) if topic == publish_module.POLICY_TOPIC else []

    async def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(publish_module, "read_all", read_all)
    monkeypatch.setattr(publish_module, "ensure_compacted", nothing)
    return records


def producing(records: list[feed.Record], fails_at: int) -> Any:
    calls = []

    async def produce(bootstrap: str, topic: str, key: str, value: bytes | None,
                      **kwargs: Any) -> None:
        calls.append(key)
        if len(calls) == fails_at:
            raise SinkUnavailable("broker away")
        records.append((key, value))
    return produce


@pytest.mark.parametrize(("fails_at", "removed", "said"), [
    (2, ["a"], "removed the feed entry of a; not of b"),
    (3, ["a", "b"], "removed the feed entry of a, b; '*' not published again above them"),
])
async def test_a_failure_part_way_names_what_was_removed_and_a_rerun_completes_it(
        topic: list[feed.Record], monkeypatch: pytest.MonkeyPatch, fails_at: int,
        removed: list[str], said: str) -> None:
    monkeypatch.setattr(publish_module, "produce", producing(topic, fails_at))
    with pytest.raises(PartlyUnpublished) as err:
        await unpublish("kafka:9092", ["a", "b"])
    assert err.value.removed == removed and said in str(err.value)
    assert "run the same command again" in str(err.value)
    monkeypatch.setattr(publish_module, "produce", producing(topic, 0))
    # what a held (2) is read from before its tombstone: '*' (1) goes out again above it
    assert await unpublish("kafka:9092", ["a", "b"]) == Unpublished(
        [], star=True, republished=4, already=removed)
    assert feed.latest(topic) == {"*": feed.encode(4, DOC)}


async def test_absent_is_a_spoke_that_never_had_an_entry(topic: list[feed.Record]) -> None:
    topic.append(("a", None))
    assert (await unpublish("kafka:9092", ["a", "c"])).absent == ["c"]
