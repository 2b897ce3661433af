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


# --- after compaction: a removed spoke's tombstone left, the value before it gone ----------


@pytest.mark.parametrize("spokes", [["a"], ["a", "b"]])
async def test_a_completed_unpublish_run_again_after_compaction_changes_nothing(
        topic: list[feed.Record], monkeypatch: pytest.MonkeyPatch, spokes: list[str]) -> None:
    """What a spoke held is unknown once compaction drops the value before its tombstone;
    it counted as above '*', so each run again published '*' once more. A '*' written after
    the tombstone was published after the entry was removed, above what the feed held."""
    monkeypatch.setattr(publish_module, "produce", producing(topic, 0))
    assert (await unpublish("kafka:9092", ["a", "b"])).republished == 4
    topic[:] = [("a", None), ("b", None), ("*", feed.encode(4, DOC))]  # compacted
    assert await unpublish("kafka:9092", spokes) == Unpublished(
        [], star=True, already=spokes)
    assert topic == [("a", None), ("b", None), ("*", feed.encode(4, DOC))]


async def test_a_star_before_the_tombstone_still_goes_out_again_once(
        topic: list[feed.Record], monkeypatch: pytest.MonkeyPatch) -> None:
    """The guarantee: '*' written before a's tombstone may be below what a held (the value
    compacted away): published again, once; the run after that changes nothing."""
    monkeypatch.setattr(publish_module, "produce", producing(topic, 0))
    topic[:] = [("*", feed.encode(1, DOC)), ("a", None)]
    assert await unpublish("kafka:9092", ["a"]) == Unpublished(
        [], star=True, republished=2, already=["a"])
    assert await unpublish("kafka:9092", ["a"]) == Unpublished([], star=True, already=["a"])
    assert feed.max_revision(topic) == 2
    # one of them after '*', one before: '*' goes out again for the one before
    topic[:] = [("b", None), ("*", feed.encode(5, DOC)), ("a", None)]
    assert (await unpublish("kafka:9092", ["a", "b"])).republished == 6
    assert (await unpublish("kafka:9092", ["a", "b"])).republished is None


async def test_a_star_after_the_tombstone_but_below_the_value_known_before_it_goes_out(
        topic: list[feed.Record], monkeypatch: pytest.MonkeyPatch) -> None:
    """A '*' after the tombstone stands for the removed value only when that value is
    unknown (compacted away, unreadable): one still on the feed is what the spoke held.
    Here a held 5 and the '*' written after its tombstone is 3 (a publish that read the
    feed before a's 5 landed, numbered from below it): a never moves down to 3, so '*'
    goes out again above 5, as it did before the rule for compacted values."""
    monkeypatch.setattr(publish_module, "produce", producing(topic, 0))
    topic[:] = [("*", feed.encode(1, DOC)), ("a", feed.encode(5, DOC)), ("a", None),
                ("*", feed.encode(3, DOC))]
    assert await unpublish("kafka:9092", ["a"]) == Unpublished(
        [], star=True, republished=6, already=["a"])
    assert await unpublish("kafka:9092", ["a"]) == Unpublished([], star=True, already=["a"])
