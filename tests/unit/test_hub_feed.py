"""The policy feed's rules without Kafka: which entry a spoke follows, the one revision
sequence, and what a syncer does with an entry (apply, hold, refuse)."""

from __future__ import annotations

import orjson
import pytest

from gateway.hub import feed
from gateway.hub.last_good import LastGood
from gateway.policy.loader import parse_doc

GOOD = {"models": {"m": {}}, "teams": {"t": {"models": ["*"]}}}
BAD = {"models": {"m": {"limits": {"rps": -3}}}}


def value(revision: int, policy: dict[str, object] = GOOD) -> bytes:
    return feed.encode(revision, policy)


def test_latest_keeps_the_last_value_per_key_and_a_tombstone_removes_it() -> None:
    records = [("*", value(1)), ("a", value(2)), ("*", value(3)), ("a", None), ("b", value(4))]
    assert feed.latest(records) == {"*": value(3), "b": value(4)}
    assert feed.latest([*records, ("a", value(5))])["a"] == value(5)


def test_next_revision_counts_removed_superseded_and_skips_unreadable_values() -> None:
    records = [("a", value(7)), ("a", None), ("*", value(3)), ("x", b"{not json")]
    assert feed.max_revision(records) == 7  # the sequence never goes back
    assert feed.max_revision([]) == 0
    # a readable revision counts whatever its policy (its spoke NACKs it): the number is taken
    for policy in (b'"x"', b"null", b"[1]", b"{}"):
        raw = b'{"revision": 9, "policy": ' + policy + b"}"
        assert feed.max_revision([*records, ("q", raw)]) == 9, raw
    assert feed.max_revision([*records, ("q", b'{"revision": 9}')]) == 9
    # not a revision at all: no number taken (a string, 0, or past 2**53 - 1: NACKed)
    for rev in (b'"9"', b"0", b"true", str(feed.MAX_REVISION + 1).encode()):
        assert feed.max_revision([*records, ("q", b'{"revision": ' + rev + b"}")]) == 7


def test_the_first_record_of_a_revision_is_the_one_an_in_order_reader_took() -> None:
    records = [("*", value(1)), ("x", b"junk"), ("a", None), ("a", value(2)),
               ("*", value(2, {"models": {"n": {}}}))]
    assert feed.first_with(records, 2) == ("a", value(2))
    assert feed.first_with(records, 1) == ("*", value(1))
    assert feed.first_with(records, 3) is None


def test_a_spoke_follows_its_own_entry_else_every_spokes() -> None:
    current = {"*": value(3), "a": value(5)}
    assert feed.entry_for(current, "a") == ("a", value(5))
    assert feed.entry_for(current, "b") == ("*", value(3))
    assert feed.entry_for({"a": value(5)}, "b") is None
    assert feed.feed_revision(current, "b") == 3
    assert feed.feed_revision({"*": b"junk"}, "b") is None


def test_a_newer_valid_revision_is_applied_as_exactly_that_revision() -> None:
    got = feed.decide("llm.policy.v1[*]", value(9, {**GOOD, "revision": 2}), held=4)
    assert isinstance(got, feed.Apply)
    assert got.revision == 9 and got.doc.revision == 9  # the feed's number, not the doc's
    assert got.doc.model_copy(update={"revision": None}) == parse_doc(orjson.dumps(GOOD))


@pytest.mark.parametrize("inner", [0, -1, "7", None, 2.5])
def test_the_documents_own_revision_is_ignored_whatever_it_holds(inner: object) -> None:
    """docs/contracts.md §8: the policy's own `revision:` is ignored, N rules. A foreign hub
    that dumped its document with `revision: 0` (or a string) had every revision refused."""
    got = feed.decide("llm.policy.v1[*]", value(9, {**GOOD, "revision": inner}), held=4)
    assert isinstance(got, feed.Apply) and got.doc.revision == 9


@pytest.mark.parametrize("revision", [3, 4])
def test_an_older_or_equal_revision_is_held_even_when_invalid(revision: int) -> None:
    assert feed.decide("s", value(revision, BAD), held=4) == feed.Hold(revision)


def test_an_invalid_newer_revision_is_refused_with_the_path_of_the_error() -> None:
    got = feed.decide("llm.policy.v1[b]", value(5, BAD), held=4)
    assert isinstance(got, feed.Refuse) and got.revision == 5
    assert "llm.policy.v1[b] revision 5" in got.error
    assert "models.m.limits.rps" in got.error


@pytest.mark.parametrize(("raw", "says"), [
    (b"{oops", "not JSON"),
    (b"[1]", "not a JSON object"),
    (b'{"revision": 0, "policy": {}}', "revision: must be a positive integer"),
    (b'{"revision": true, "policy": {}}', "revision: must be a positive integer"),
    (b'{"revision": "2", "policy": {}}', "revision: must be a positive integer"),
    (b'{"revision": 2, "policy": []}', "policy: must be a JSON object"),
])
def test_an_unreadable_value_is_refused_and_says_why(raw: bytes, says: str) -> None:
    got = feed.decide("llm.policy.v1[*]", raw, held=1)
    assert isinstance(got, feed.Refuse) and got.revision is None
    assert says in got.error and got.error.startswith("llm.policy.v1[*]: ")


def test_other_fields_of_the_envelope_are_ignored_and_the_policy_still_validated() -> None:
    """A hub that adds a field to the envelope (who published it, when) is still followed;
    an unknown field inside the policy is still refused."""
    raw = orjson.dumps({"revision": 5, "policy": GOOD, "published_by": "ops", "at": 1})
    got = feed.decide("llm.policy.v1[*]", raw, held=4)
    assert isinstance(got, feed.Apply) and got.revision == 5
    bad = orjson.dumps({"revision": 6, "policy": {**GOOD, "surprise": 1}, "at": 1})
    refused = feed.decide("llm.policy.v1[*]", bad, held=5)
    assert isinstance(refused, feed.Refuse) and "surprise" in refused.error


def test_last_good_round_trips_and_survives_a_missing_or_corrupt_file(tmp_path) -> None:
    path = tmp_path / "state" / "spoke-a.json"
    assert LastGood(path).load().raw is None  # nothing yet
    doc = parse_doc(orjson.dumps(GOOD))
    LastGood(path).save(6, doc)
    again = LastGood(path).load()
    assert again.revision == 6
    assert again.raw is not None
    assert isinstance(feed.decide("disk", again.raw, held=0), feed.Apply)
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    path.write_bytes(b"{half a fi")
    assert LastGood(path).load().raw is None  # unreadable: logged, the feed tells again
