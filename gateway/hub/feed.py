"""The policy feed's rules, pure: which entry a spoke follows, and what a syncer does with it.

`llm.policy.v1` is keyed by spoke id, or `*` for every spoke; a value is JSON
`{"revision": N, "policy": {...}}` and a null value removes a spoke's own entry. Revisions
form one sequence over the topic, and a spoke never moves to a lower one than it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import PolicyError
from gateway.policy.fields import MAX_COUNT
from gateway.policy.loader import parse_doc
from gateway.policy.schema import PolicyDoc

EVERY_SPOKE = "*"

Record = tuple[str, bytes | None]  # Kafka key, value (None: a tombstone)


# JSON's safe integers (RFC 8259 §6), and Redis's: its Lua holds numbers as doubles, and
# stored 1733456789012345678 (a revision from time.time_ns()) as '1.7334567890123457e+18'.
MAX_REVISION = MAX_COUNT


class FeedValueError(ValueError):
    """A feed value that is not `{"revision": N > 0, "policy": {...}}`."""


@dataclass(frozen=True)
class FeedEntry:
    revision: int
    policy: dict[str, Any]


def _envelope(raw: bytes) -> tuple[dict[str, Any], int]:
    """The value's JSON object and its revision, whatever its policy."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise FeedValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FeedValueError("not a JSON object")
    rev = data.get("revision")
    if not isinstance(rev, int) or isinstance(rev, bool) or rev <= 0:
        raise FeedValueError(f"revision: must be a positive integer, got {rev!r}")
    if rev > MAX_REVISION:
        raise FeedValueError(f"revision: must be at most 2**53 - 1, got {rev}")
    return data, rev


def parse_value(raw: bytes) -> FeedEntry:
    data, rev = _envelope(raw)
    policy = data.get("policy")
    if not isinstance(policy, dict):
        raise FeedValueError("policy: must be a JSON object (a policy document)")
    # Other fields of the envelope are ignored: a hub that adds one (who published, when)
    # must not make every spoke it feeds refuse every revision. The policy inside is
    # validated strictly, unknown fields refused, as `policy apply` does.
    return FeedEntry(rev, policy)


def encode(revision: int, policy: dict[str, Any]) -> bytes:
    return orjson.dumps({"revision": revision, "policy": policy})


def latest(records: Iterable[Record]) -> dict[str, bytes]:
    """The value each key holds now, in topic order (compaction's meaning): a tombstone
    removes the key."""
    out: dict[str, bytes] = {}
    for key, value in records:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def last_values(records: Iterable[Record]) -> dict[str, bytes | None]:
    """Each key's last value on the topic, its tombstone or not: what a spoke following its
    own entry held before that entry was removed. None: only a tombstone is left (the value
    before it compacted away); a key never on the topic is not there."""
    out: dict[str, bytes | None] = {}
    for key, value in records:
        if value is not None or key not in out:
            out[key] = value
    return out


def _revisions(records: Iterable[Record]) -> Iterator[tuple[str, bytes, int]]:
    """(key, value, revision) of each value with a readable revision, in topic order. Its
    policy need not be a document: a value a tool produced by hand with no policy object
    took its number as much as one whose document fails validation (both NACKed)."""
    for key, value in records:
        if value is not None:
            try:
                yield key, value, _envelope(value)[1]
            except FeedValueError:
                continue


def max_revision(records: Iterable[Record]) -> int:
    """The highest revision ever put on the feed (superseded, removed and refused ones
    included): the next publish takes this + 1, so the sequence never goes back."""
    return max((rev for _, _, rev in _revisions(records)), default=0)


def first_with(records: Iterable[Record], revision: int) -> Record | None:
    """The first record on the feed that carries `revision`: the one a spoke that read the
    topic in order took as that revision (a later one with the same number it holds)."""
    return next(((key, value) for key, value, rev in _revisions(records) if rev == revision),
                None)


def entry_for(current: dict[str, bytes], spoke: str) -> tuple[str, bytes] | None:
    """The (key, value) a spoke follows: its own entry where it has one, else `*`'s."""
    for key in (spoke, EVERY_SPOKE):
        if key in current:
            return key, current[key]
    return None


def feed_revision(current: dict[str, bytes], spoke: str) -> int | None:
    """The revision the feed holds for `spoke` (None: no entry, or an unreadable one)."""
    found = entry_for(current, spoke)
    if found is None:
        return None
    try:
        return parse_value(found[1]).revision
    except FeedValueError:
        return None


@dataclass(frozen=True)
class Apply:
    revision: int
    doc: PolicyDoc  # validated, carrying `revision`


@dataclass(frozen=True)
class Hold:
    """Nothing to do: the entry is not newer than what the spoke holds."""
    revision: int


@dataclass(frozen=True)
class Refuse:
    """An entry that fails validation: NACKed upward, never applied."""
    revision: int | None  # None: not even the revision could be read
    error: str


Decision = Apply | Hold | Refuse


def decide(source: str, raw: bytes, held: int) -> Decision:
    """What a syncer whose spoke holds revision `held` does with the feed value `raw` (from
    `source`, which errors name, e.g. `llm.policy.v1[*]`).

    A lower or equal revision is held whatever it contains (never go back); a newer one is
    validated exactly as `policy apply` validates a file, and applied as that revision.
    """
    try:
        entry = parse_value(raw)
    except FeedValueError as exc:
        return Refuse(None, f"{source}: {exc}")
    if entry.revision <= held:
        return Hold(entry.revision)
    source = f"{source} revision {entry.revision}"
    policy = {k: v for k, v in entry.policy.items() if k != "revision"}  # N rules, not its own
    try:
        doc = parse_doc(orjson.dumps(policy), source)
    except PolicyError as err:
        return Refuse(entry.revision, str(err))
    return Apply(entry.revision, doc.model_copy(update={"revision": entry.revision}))
