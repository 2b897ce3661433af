"""`gateway hub publish`: a validated document onto the feed as the next revision.

Validation is `policy apply`'s (the same parser: an invalid file publishes nothing), and so
is its empty-document rule: a document with no models or no keys would have every spoke that
takes it refuse every request, so it is refused unless `allow_empty` (`--allow-empty`). The
hub cannot see what each spoke holds, so any empty section is refused, whatever the feed held
before. (`policy apply`'s `--prune` rule is not applied: only the hub's own commands write
the feed, so no key on it was made elsewhere (`keys create`), and dropping a key from the
hub's file is how the hub revokes one.)

The revision is the feed's one sequence: the highest ever put on the topic + 1, read from
the topic itself, so the hub keeps no state of its own; and above the highest revision any
instance reports on the status topic, so that a spoke holding a number the feed never gave
(the topic lost and started again at 1, or a `policy apply` into the spoke's Redis) takes
the next publish instead of holding it as not newer.

Two publishers at the same instant can take the same number, and a spoke keeps the first
record of a number and holds the next (it never moves to a revision not newer than its
own). So a publish reads the topic back: if another record took its number first, it lost
the race and publishes again as the next number, until its record is the first of its
number. Every publish then lands, the later one last, whatever the interleaving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from gateway.errors import ApplyRefused, GatewayError, SinkUnavailable
from gateway.hub import feed, fleet
from gateway.hub.topics import (
    POLICY_TOPIC,
    RECORD_MAX_BYTES,
    STATUS_TOPIC,
    ensure_compacted,
    produce,
    read_all,
)
from gateway.log import log
from gateway.policy.admin import empty_refusal
from gateway.policy.loader import parse_doc, to_data

ATTEMPTS = 10  # publishes racing for one number: each round at least one of them lands


async def publish(bootstrap: str, text: bytes, source: str, spoke: str = feed.EVERY_SPOKE,
                  *, idempotence: bool = True, allow_empty: bool = False,
                  warn: Callable[[str], None] | None = None, replication: int = 1) -> int:
    """Validate `text` (PolicyError, naming the path; ApplyRefused if it has no models or no
    keys and not `allow_empty`: nothing published) and put it on the feed for `spoke` (`*`:
    every spoke without its own entry); its revision. `warn` is told, before anything is
    published, what is accepted but likely not meant (a key that may use no model). The
    feed is created on `replication` brokers (GATEWAY_TOPIC_REPLICATION) if missing;
    TopicRefused if the broker refuses and it does not exist: nothing published."""
    if spoke != feed.EVERY_SPOKE and (not spoke.strip() or "/" in spoke):
        # GATEWAY_SPOKE's own rules: no spoke could follow such a key
        raise ValueError(f"--spoke: a spoke id (not blank, no '/'), or * for every spoke; "
                         f"got {spoke!r}")
    doc = parse_doc(text, source)
    if warn is not None:
        for warning in doc.acl_warnings():
            warn(warning)
    if refused := empty_refusal(source, doc, None, allow_empty=allow_empty):
        raise ApplyRefused(refused)  # before Kafka is asked
    data = to_data(doc)
    # a feed the broker refused to create, and not there: TopicRefused, nothing produced
    # (a broker that auto-creates topics would make it plain; DESIGN §10: it is compacted)
    await ensure_compacted(bootstrap, POLICY_TOPIC, RECORD_MAX_BYTES, replication=replication,
                           required=True)
    held = await _highest_reported(bootstrap)
    records = await read_all(bootstrap, POLICY_TOPIC)
    for _ in range(ATTEMPTS):
        revision = max(feed.max_revision(records), held) + 1
        value = feed.encode(revision, data)
        await produce(bootstrap, POLICY_TOPIC, spoke, value, idempotence=idempotence)
        records = await read_all(bootstrap, POLICY_TOPIC)
        if feed.first_with(records, revision) == (spoke, value):
            return revision
        log.warning("publish_raced", revision=revision, spoke=spoke,
                    note="another publish took this number first; publishing as the next")
    raise SinkUnavailable(f"revision {revision} and the {ATTEMPTS - 1} before it were each "
                          "taken first by another publish; spokes may hold this document "
                          "or not: publish it again")


@dataclass(frozen=True)
class Unpublished:
    absent: list[str]  # spokes that never had an entry of their own: nothing was removed
    star: bool = False  # a readable `*` entry is there to follow
    republished: int | None = None  # the revision `*`'s document was published again as
    already: list[str] = field(default_factory=list)  # removed before (an earlier run)


class PartlyUnpublished(SinkUnavailable):
    """A run failed part way: `removed` have no entry of their own any more (this run's and
    earlier runs'), `left` still have theirs, and `*` may not be above what they held. The
    same command, run again, completes it."""

    def __init__(self, removed: list[str], left: list[str], cause: Exception) -> None:
        self.removed, self.left = removed, left
        done = f"removed the feed entry of {', '.join(removed)}" if removed else "removed none"
        rest = (f"not of {', '.join(left)}" if left
                else "'*' not published again above them")
        super().__init__(f"{done}; {rest} ({cause}): run the same command again to "
                         "complete it")


async def unpublish(bootstrap: str, spokes: list[str], *,
                    idempotence: bool = True, replication: int = 1) -> Unpublished:
    """Remove each spoke's own feed entry (a null value, DESIGN §10). Not atomic (one
    record per spoke), so safe to run again: a spoke whose entry is already removed counts
    as done, and what its spokes held is read from the topic's log (the value before each
    tombstone), so a run that failed part way (PartlyUnpublished) is completed by the same
    command. A spoke never moves to a revision lower than it holds, so one that held its
    own entry, above `*`'s (the usual order: `*` first, then the exception), would keep
    serving the removed document until `*` next changes: `*`'s document, published again
    as the next revision, is what it follows at once.

    Once compaction drops the value before a removed entry's tombstone (or that value has
    no readable revision), what its spoke held is unknown; it counts as above `*`, unless
    `*`'s entry was written after that tombstone (compaction keeps the log's order). That
    `*` was published (by a run of this, or `hub publish`) after the entry was removed, so
    above every revision then on the feed, the removed value too unless already compacted
    away, and above every revision an instance reported (the spoke holding it, if up):
    `*` published again now would know no more. So a run again after a completed one
    changes nothing, and says so. A `*` before the tombstone (above the entry already when
    it was removed, or a run that failed before publishing `*` again) may be below what
    the spoke held: it goes out again, once (after that it is after the tombstone)."""
    records = await read_all(bootstrap, POLICY_TOPIC)
    current, held = feed.latest(records), feed.last_values(records)
    absent = [s for s in spokes if s not in held]
    if absent:
        return Unpublished(absent)
    already = [s for s in spokes if s not in current]
    star_after = _written_after(records, feed.EVERY_SPOKE)
    removed = list(already)
    try:
        for spoke in spokes:
            if spoke in current:
                await produce(bootstrap, POLICY_TOPIC, spoke, None, idempotence=idempotence)
                removed.append(spoke)
        star, revision = await _star_above(
            bootstrap, current,
            [_held_revision(held[s], s in already and s in star_after) for s in spokes],
            idempotence, replication)
    except GatewayError as exc:  # Kafka away part way (or `*` not publishable again)
        raise PartlyUnpublished(removed, [s for s in spokes if s not in removed], exc
                                ) from exc
    return Unpublished([], star=star, republished=revision, already=already)


async def _star_above(bootstrap: str, current: dict[str, bytes], held: list[int],
                      idempotence: bool, replication: int) -> tuple[bool, int | None]:
    """Whether there is a readable `*` to follow, and the revision its document was
    published again as, if it was not above every revision the spokes held already."""
    star = current.get(feed.EVERY_SPOKE)
    try:
        every = feed.parse_value(star) if star is not None else None
    except feed.FeedValueError:
        every = None
    if every is None:
        return False, None  # nothing to follow: the spokes keep what they hold
    if every.revision > max(held):
        return True, None  # already above what they held: followed at once
    revision = await publish(bootstrap, orjson.dumps(every.policy), f"{POLICY_TOPIC}[*]",
                             idempotence=idempotence, allow_empty=True,
                             replication=replication)
    return True, revision


def _written_after(records: list[feed.Record], key: str) -> set[str]:
    """The keys whose last record (for a removed entry, its tombstone) is before `key`'s
    current value on the topic (compaction keeps the order): none if `key` has no value."""
    last = {k: at for at, (k, _) in enumerate(records)}
    at = last.get(key)
    if at is None or records[at][1] is None:
        return set()
    return {k for k, i in last.items() if i < at}


def _held_revision(value: bytes | None, star_after: bool) -> int:
    """What a removed entry's spoke held: its last value's revision. Unknown (compacted
    away, None, or no readable revision), its spoke may hold anything: above everything,
    unless `star_after` (`*` written after its tombstone, so above what the feed and the
    instances then said: 0). A value still known is used whatever `*`'s place: a `*` after
    the tombstone can still be below it (numbered by a publish that read the feed before
    that value landed, the value numbered above it from what the instances reported)."""
    if value is not None:
        try:
            return feed.parse_value(value).revision
        except feed.FeedValueError:
            pass
    return 0 if star_after else feed.MAX_REVISION


async def _highest_reported(bootstrap: str) -> int:
    """The highest revision an instance reports; best effort: a status topic that cannot be
    read whole in time (Tansu never compacts it) leaves the feed's own number."""
    try:
        return fleet.highest_reported(feed.latest(await read_all(bootstrap, STATUS_TOPIC)))
    except SinkUnavailable as exc:
        log.warning("publish_without_status", error=str(exc),
                    note="the revision is the feed's own next; a spoke above it holds it")
        return 0
