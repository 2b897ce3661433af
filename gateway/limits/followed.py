"""The admissions a ledger follows, filed by what its renewal loop does with each.

Pure bookkeeping, no I/O: the ledger (gateway/limits/ledger.py) decides the transitions,
this keeps every live admission where the renewal loop looks for it, so that a tick costs
what it renews, not what is followed:

    renewed   renewed at each round of everyone (a begun stream, a watched admission)
    fresh     of those, not renewed yet: renewed at the next tick, between rounds too
    unbegun   admitted here, not watched: forgotten once the first lease has run out
              (its stream began in another process, or never)

and the ended ones, remembered a while so that a late or repeated call about them is
recognised. `gateway_admissions_open` is len(renewed), set as it changes: a drain waits
on it reaching 0.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway import metrics
from gateway.limits.stages import Admission, Stage

# Ended admissions are remembered this long (at most this many), so that a late or repeated
# call about them is recognised: a heartbeat after the end, a release after the settlement.
ENDED_KEEP_S = 120.0
ENDED_MAX = 100_000


class Followed:
    def __init__(self) -> None:
        self.live: dict[str, Admission] = {}
        self.renewed: dict[str, Admission] = {}
        self.fresh: dict[str, Admission] = {}
        self.unbegun: dict[str, Admission] = {}
        self.ended: OrderedDict[str, Admission] = OrderedDict()  # oldest end first
        self._open = 0  # len(self.renewed) as last put in the gauge (one ledger a process)
        metrics.ADMISSIONS_OPEN.set(0)

    def find(self, request_id: str) -> Admission | None:
        a = self.live.get(request_id)
        return a if a is not None else self.ended.get(request_id)

    def hold(self, request_id: str, a: Admission) -> None:
        """Follow it (again), after any change to it."""
        self.ended.pop(request_id, None)
        self.live[request_id] = a
        self.track(request_id, a)

    def track(self, request_id: str, a: Admission) -> None:
        """File a live admission by what the renewal loop does with it, after each change."""
        if a.renewed():
            self.renewed[request_id] = a
            if a.fresh:
                self.fresh[request_id] = a
            else:
                self.fresh.pop(request_id, None)
            self.unbegun.pop(request_id, None)
        else:
            self.renewed.pop(request_id, None)
            self.fresh.pop(request_id, None)
            if a.stage is Stage.ADMITTED:
                self.unbegun[request_id] = a
            else:
                self.unbegun.pop(request_id, None)
        self._count()

    def renewed_once(self, request_id: str, a: Admission) -> None:
        """Its first renewal is done: from now on only rounds of everyone renew it (unless
        it ended, or was taken on again, meanwhile)."""
        if self.fresh.get(request_id) is a:
            a.fresh = False
            del self.fresh[request_id]

    def drop(self, request_id: str) -> None:
        """No longer followed, nor remembered."""
        self.live.pop(request_id, None)
        self.renewed.pop(request_id, None)
        self.fresh.pop(request_id, None)
        self.unbegun.pop(request_id, None)
        self._count()

    def remember(self, request_id: str, a: Admission, stage: Stage, now: float) -> None:
        """No longer followed: it ended as `stage`, kept a while."""
        self.drop(request_id)
        a.stage, a.ended_at, a.progress = stage, now, None
        self.ended[request_id] = a
        self.ended.move_to_end(request_id)
        if len(self.ended) > ENDED_MAX:
            self.ended.popitem(last=False)

    def forget_old(self, now: float, first_lease: float) -> None:
        """Drop the unbegun past their first lease and the ended past ENDED_KEEP_S."""
        for rid in [r for r, a in self.unbegun.items() if now - a.since >= first_lease]:
            self.drop(rid)
        while self.ended and next(iter(self.ended.values())).ended_at < now - ENDED_KEEP_S:
            self.ended.popitem(last=False)

    def _count(self) -> None:
        if len(self.renewed) != self._open:
            self._open = len(self.renewed)
            metrics.ADMISSIONS_OPEN.set(self._open)
