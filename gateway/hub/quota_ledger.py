"""What the allocator knows, folded from the topics alone (pure: no I/O, no clock).

Restarted, the allocator reads the topics from their beginning into a fresh ledger and
carries on where it stopped: the usage each spoke reported (`llm.usage.v1`), the global
quotas (`llm.policy.v1`), its own last allowances and the spokes' reports of applying
them (`llm.quota.v1`, docs/contracts.md §9). Nothing is handed out twice: an allowance
counts as held by its spoke until that spoke reports the next one applied.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from gateway.hub.allocation import SpokeUse, allocate
from gateway.limits import maths
from gateway.policy.model import weights_of
from gateway.policy.schema import PolicyDoc
from gateway.token_weights import TokenWeights, limit_tokens
from gateway.usage_event import Usage

Cell = tuple[str, str, str]  # (scope 'team:<name>' | 'key:<id>', 'day' | 'month', period id)
Quota = tuple[str, str]  # (scope, period)


def period_id(period: str, ts: float) -> str:
    return maths.day_id(ts) if period == "day" else maths.month_id(ts)


def quotas_of(policy: Mapping[str, Any]) -> dict[Quota, int]:
    """The global limits one policy document names (raises ValidationError if invalid)."""
    return _quotas(PolicyDoc.model_validate(policy))


def _quotas(doc: PolicyDoc) -> dict[Quota, int]:
    out: dict[Quota, int] = {}
    sources = [(f"team:{n}", t.global_limits) for n, t in doc.teams.items()]
    sources += [(f"key:{k}", key.global_limits) for k, key in doc.keys.items()]
    for scope, g in sources:
        if g.tokens_per_day is not None:
            out[scope, "day"] = g.tokens_per_day
        if g.tokens_per_month is not None:
            out[scope, "month"] = g.tokens_per_month
    return out


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


DEMAND_WINDOW_S = 60.0  # a spoke's demand: what it used over about this long
# A spoke that has not reported applying an allowance issued this long ago is silent: it is
# given no more than it holds (what it enforces anyway if it is cut off) until it reports.
SILENT_S = 60.0


class QuotaLedger:
    def __init__(self, demand_window_s: float = DEMAND_WINDOW_S,
                 silent_s: float = SILENT_S) -> None:
        self.demand_window_s = demand_window_s
        self.silent_s = silent_s
        self.generation = 0  # one sequence over all spokes' allowances
        self.spokes: set[str] = set()
        self._following: set[str] = set()  # spokes whose follower has reported (hello too)
        self._feed: dict[str, dict[Quota, int]] = {}  # per policy feed key ('*' or a spoke)
        # ... and the token weights of its models: a spoke counts those models' tokens
        # weighted toward its global quotas, so their events count so here too
        self._weights: dict[str, dict[str, TokenWeights]] = {}
        self._used: dict[tuple[str, Cell], int] = defaultdict(int)  # from usage events
        self._seen: dict[str, set[str]] = defaultdict(set)  # event ids per day id (dedup)
        self._issued: dict[str, tuple[int, dict[Cell, tuple[int, int]]]] = {}  # (allowance, bound)
        self._applied: dict[str, tuple[int, dict[Cell, tuple[int, int]]]] = {}  # (allowance, used)
        self._pending: dict[str, dict[Cell, int]] = defaultdict(dict)  # issued, not yet applied
        # when the oldest allowance the spoke has not answered (by any report) was issued
        self._unanswered_since: dict[str, float] = {}
        self._issued_at: dict[str, float] = {}  # when its newest allowance was issued
        self._entries: dict[str, list[dict[str, Any]]] = {}  # its newest message's entries
        # (time, used) at each allocation, over the demand window and one before it
        self._samples: dict[tuple[str, Cell], list[tuple[float, int]]] = defaultdict(list)
        self.rejected_policies: dict[str, str] = {}  # feed key → why its quotas were not taken

    # --- folding the topics -----------------------------------------------------------

    def on_policy(self, feed_key: str, value: Mapping[str, Any] | None) -> None:
        """A feed entry (`{"revision", "policy"}`); None removes it. An invalid one keeps
        the entry's previous quotas (the spokes NACK it and keep their revision too)."""
        if value is None:
            self._feed.pop(feed_key, None)
            self._weights.pop(feed_key, None)
            return
        try:
            doc = PolicyDoc.model_validate(value["policy"])
            self._feed[feed_key] = _quotas(doc)
            self._weights[feed_key] = weights_of(doc)
            self.rejected_policies.pop(feed_key, None)
        except (ValidationError, KeyError, TypeError) as exc:
            self.rejected_policies[feed_key] = str(exc).splitlines()[0]

    def on_usage(self, event: Mapping[str, Any]) -> None:
        """One usage event; a duplicate (same event_id) counts once. A model with token
        weights in the spoke's feed entry (its own, else '*') counts its limit tokens, as
        the spoke's counters do; any other, its total."""
        try:
            spoke, eid = str(event["spoke"]), str(event["event_id"])
            u = event.get("usage") or {}
            tokens = int(u.get("total_tokens") or 0)
            weights = self._weights.get(spoke, self._weights.get("*")) or {}
            if weights and (w := weights.get(str(event.get("model")))) is not None:
                tokens = limit_tokens(Usage(
                    int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0),
                    tokens, int(u.get("cached_tokens") or 0), 0,
                    int(u.get("cache_creation_tokens") or 0)), w)
            started = _ts(str(event["started_at"]))
        except (KeyError, TypeError, ValueError):
            return
        self.spokes.add(spoke)
        day = maths.day_id(started)
        if eid in self._seen[day] or tokens <= 0:
            return
        self._seen[day].add(eid)
        for scope in (f"team:{event.get('team')}", f"key:{event.get('key_id')}"):
            for period in ("day", "month"):
                self._used[spoke, (scope, period, period_id(period, started))] += tokens

    def on_allowance(self, spoke: str, msg: Mapping[str, Any], at: float | None = None) -> None:
        """The allocator's own message (read back when it restarts: issued at its `at`)."""
        gen = int(msg["generation"])
        if at is None and msg.get("at"):
            at = _ts(str(msg["at"]))
        self.spokes.add(spoke)
        self.generation = max(self.generation, gen)
        cells = {(e["scope"], e["period"], e["period_id"]): (int(e["allowance"]), int(e["bound"]))
                 for e in msg["allowances"]}
        self._issued[spoke] = (gen, cells)
        self._entries[spoke] = [dict(e) for e in msg["allowances"]]
        if self._applied.get(spoke, (0, {}))[0] < gen:  # not yet answered (a report may
            # be read before the message it answers: the topic's keys are not ordered)
            self._pending[spoke] = {c: bound for c, (_, bound) in cells.items()}
            if at is not None:
                self._issued_at[spoke] = at
                self._unanswered_since.setdefault(spoke, at)

    def on_applied(self, spoke: str, msg: Mapping[str, Any]) -> bool:
        """A spoke's report of the allowances it applied (generation 0: it is up, none yet).
        True if it frees a share held until now (worth allocating again at once)."""
        gen = int(msg["generation"])
        new = spoke not in self._following
        self.spokes.add(spoke)
        self._following.add(spoke)
        holds = int(msg.get("holds") or 0)  # a hello: the generation the spoke holds
        if holds > self._issued.get(spoke, (0, {}))[0]:
            # It holds a generation this ledger never issued (the quota topic was lost):
            # continue above it, and send that spoke its allowances again.
            self.generation = max(self.generation, holds)
            self._issued.pop(spoke, None)
            new = True
        # It answers: only what was issued since it applied its last one is unanswered.
        self._unanswered_since.pop(spoke, None)
        if spoke in self._pending and spoke in self._issued_at:
            self._unanswered_since[spoke] = self._issued_at[spoke]
        if gen <= 0 or gen < self._applied.get(spoke, (0, {}))[0]:
            return new
        cells = {(e["scope"], e["period"], e["period_id"]): (int(e["allowance"]), int(e["used"]))
                 for e in msg["applied"]}
        self._applied[spoke] = (gen, cells)
        freed = False
        if gen >= self._issued.get(spoke, (0, {}))[0]:
            pending = self._pending.pop(spoke, {})
            self._unanswered_since.pop(spoke, None)
            freed = any(bound > cells.get(c, (bound, 0))[0] for c, bound in pending.items())
        return new or freed

    # --- deciding ---------------------------------------------------------------------

    def quotas(self) -> dict[Quota, int]:
        """Every feed entry's global limits; where entries disagree, the smallest."""
        out: dict[Quota, int] = {}
        for entry in self._feed.values():
            for q, n in entry.items():
                out[q] = min(n, out.get(q, n))
        return out

    def use(self, spoke: str, cell: Cell, quota: int, now: float | None = None) -> SpokeUse:
        applied = self._applied.get(spoke, (0, {}))[1].get(cell)
        used = max(self._used.get((spoke, cell), 0), applied[1] if applied else 0)
        # Until it reports an allowance for this cell it may be on the fallback share: of
        # the quota in the feed entry it serves (its own, else '*'), not the smallest.
        held = applied[0] if applied else maths.fallback_allowance(
            self._served_quota(spoke, cell, quota))
        held = max(held, self._pending.get(spoke, {}).get(cell, 0))
        samples = self._samples.get((spoke, cell))
        demand = max(0, used - samples[0][1]) if samples else 0
        # A spoke known from its usage alone (no follower) cannot apply an allowance, nor
        # one silent (`silent`): it stays on what it holds (in a new period, the fallback
        # share), and what it is not given stays with the others.
        following = spoke in self._following and not (now is not None and self.silent(spoke, now))
        cap = None if following else max(used, held)
        return SpokeUse(used, held, demand, cap)

    def silent(self, spoke: str, now: float) -> bool:
        """It has not reported applying an allowance issued `silent_s` or more ago (cut off,
        or gone: the allocator cannot tell which)."""
        since = self._unanswered_since.get(spoke)
        return since is not None and now - since >= self.silent_s

    def _served_quota(self, spoke: str, cell: Cell, quota: int) -> int:
        """The quota in the feed entry `spoke` serves (its own where it has one, else '*'),
        `quota` where that entry names none."""
        entry = self._feed.get(spoke, self._feed.get("*")) or {}
        return entry.get((cell[0], cell[1]), quota)

    def _sample(self, spoke: str, cell: Cell, now: float, used: int) -> None:
        samples = self._samples[spoke, cell]
        samples.append((now, used))
        while len(samples) > 1 and samples[1][0] <= now - self.demand_window_s:
            samples.pop(0)

    def next_round(self, now: float) -> dict[str, dict[str, Any]]:
        """The allowances to publish now, per spoke whose allowances change: each message
        takes the next generation. Records them as issued (and held) at once."""
        self.forget_before(now)
        if not self.spokes:
            return {}
        spokes = sorted(self.spokes)
        entries: dict[str, list[dict[str, Any]]] = {s: [] for s in spokes}
        for (scope, period), quota in sorted(self.quotas().items()):
            cell = (scope, period, period_id(period, now))
            uses = {s: self.use(s, cell, quota, now) for s in spokes}
            for s, allowance in allocate(quota, uses).items():
                bound = max(allowance, uses[s].held, uses[s].used)
                # `used`: its usage events' tokens, to which the spoke raises its counter (a
                # quota added mid-period counts the period's earlier use there too, as
                # `allocate` counts it here). Not its reports' `used`: that counted
                # reservations which settling may since have given back.
                entries[s].append({"scope": scope, "period": period, "period_id": cell[2],
                                   "quota": quota, "allowance": allowance, "bound": bound,
                                   "used": self._used.get((s, cell), 0)})
                self._sample(s, cell, now, uses[s].used)
        out: dict[str, dict[str, Any]] = {}
        for s in spokes:
            # A quota gone from the feed: its spoke keeps the allowance in its Redis (a
            # message without it deletes nothing), and admission reads it again if the
            # quota comes back this period. So it is sent on unchanged till the period
            # ends, and counted as held like any other.
            have = {(e["scope"], e["period"], e["period_id"]) for e in entries[s]}
            entries[s] += [e for e in self._entries.get(s, [])
                           if (e["scope"], e["period"], e["period_id"]) not in have
                           and e["period_id"] == period_id(e["period"], now)]
            issued = self._issued.get(s, (0, {}))[1]
            now_cells = {(e["scope"], e["period"], e["period_id"]): e["allowance"]
                         for e in entries[s]}
            if now_cells == {c: a for c, (a, _) in issued.items()}:
                continue
            self.generation += 1
            msg = {"kind": "allowance", "spoke": s, "generation": self.generation,
                   "allowances": entries[s]}
            self.on_allowance(s, msg, now)
            out[s] = msg
        return out

    def forget_before(self, now: float) -> None:
        """Drop what only past periods need (yesterday and last month are kept: late events)."""
        days = {maths.day_id(now), maths.day_id(now - maths.DAY)}
        # last month: `now` less its day of the month in days (32 days back from the 1st
        # to the 4th is the month before last: it has 28 to 31 days)
        months = {maths.month_id(now), maths.month_id(now - int(maths.day_id(now)[6:]) * maths.DAY)}

        def live(cell: Cell) -> bool:
            return cell[2] in (days if cell[1] == "day" else months)

        for d in [d for d in self._seen if d not in days]:
            del self._seen[d]
        for store in (self._used, self._samples):
            for k in [k for k in store if not live(k[1])]:
                del store[k]

    def allowances(self, spoke: str) -> dict[Cell, int]:
        """The newest allowances issued to `spoke`."""
        return {c: a for c, (a, _) in self._issued.get(spoke, (0, {}))[1].items()}
