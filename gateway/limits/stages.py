"""The stages of an admission and which transition may follow which (the diagram:
gateway/limits/ledger.py): the ledger's vocabulary, apart from its bookkeeping and its store
calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

# (prompt, completion[, weighted[, cached, created]]) tokens so far:
# gateway/limits/types.py Checkpoint
Progress = Callable[[], tuple[int, int] | tuple[int, int, int]
                    | tuple[int, int, int, int, int] | None]


class Stage(Enum):
    """Where an admission stands, as this process knows it (one it knows nothing of has no
    stage: it may be another process's, or from before a restart)."""

    ADMITTED = "admitted"  # the Check admitted it here; watched: renewed while Envoy says it lives
    BEGUN = "begun"  # its metering stream began here: renewed, with its usage so far
    RELEASED = "released"  # its response ended, its slots are freed; the settlement follows
    UNHEARD = "unheard"  # watched, but not heard of for `unheard_s`: no longer renewed
    EXPIRED = "expired"  # older than the maximum lifetime: never renewed again
    SETTLED = "settled"  # its reservation replaced by what it used: done
    VOIDED = "voided"  # its caller gave up on it: released, charged nothing
    ORPHANED = "orphaned"  # handed to (or claimed by) the orphan sweep, which bills it


LIVE = frozenset({Stage.ADMITTED, Stage.BEGUN, Stage.RELEASED})  # followed here
GIVEN_UP = frozenset({Stage.UNHEARD, Stage.EXPIRED})  # the store holds them until the sweep
# The rest are remembered a while (followed.ENDED_KEEP_S), as ended.

# The stages each transition may come from (None: unknown here). A given-up admission may
# still end; an ended id is admitted (or begun elsewhere) again only by a new request that
# reuses it; a void is always safe (it charges nothing, and a late admission of a reused id
# must not commit).
FROM: dict[str, frozenset[Stage | None]] = {
    "admitted": frozenset({None, *GIVEN_UP, Stage.SETTLED, Stage.VOIDED, Stage.ORPHANED}),
    "begun": frozenset({None, Stage.ADMITTED, Stage.SETTLED}),
    "heard": frozenset({None, Stage.ADMITTED, *GIVEN_UP}),
    "released": frozenset({None, Stage.ADMITTED, Stage.BEGUN, *GIVEN_UP}),
    "settled": frozenset({None, *LIVE, *GIVEN_UP}),
    "voided": frozenset({None, *LIVE, *GIVEN_UP, Stage.SETTLED, Stage.ORPHANED}),
    "orphaned": frozenset({None, *LIVE, *GIVEN_UP}),
}
# A transition repeated from the stage it leads to changes nothing (idempotence).
REPEATS = {"admitted": Stage.ADMITTED, "begun": Stage.BEGUN, "released": Stage.RELEASED,
           "settled": Stage.SETTLED, "voided": Stage.VOIDED, "orphaned": Stage.ORPHANED}


@dataclass(slots=True)
class Admission:
    """One admission as this process follows it."""

    stage: Stage
    since: float  # when this process learned of it: its lifetime counts from here
    heard_until: float | None = None  # watched: renewed until then, unless heard of again
    progress: Progress | None = None  # its usage so far, checkpointed at each renewal
    fresh: bool = True  # not renewed yet: renewed at the next tick, not the next round
    ended_at: float = 0.0

    def renewed(self) -> bool:
        watched = self.stage is Stage.ADMITTED and self.heard_until is not None
        return watched or self.stage is Stage.BEGUN
