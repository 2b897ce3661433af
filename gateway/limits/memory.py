"""In-process limiter for the embedded mode (one process, no Redis): same semantics as Lua."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.limits import maths
from gateway.limits.allowances import PERIOD_WINDOW, Allowance, AllowanceStore, Applied
from gateway.limits.standing import Counters
from gateway.limits.tightest import Tightest
from gateway.limits.types import (
    CONCURRENCY,
    GTPD,
    GTPMO,
    RPS,
    TPD,
    TPM,
    TPMO,
    Abandon,
    AdmitRequest,
    Admitted,
    Checkpoint,
    DuplicateId,
    Ending,
    Limiter,
    Orphan,
    RateInfo,
    Refused,
    Release,
    Settle,
    Verdict,
    first_lease,
)
from gateway.policy.model import TierLimit


@dataclass
class _Held:
    """What one admitted request holds, so settlement can undo exactly that."""

    lease_keys: list[str]
    token_keys: list[str]
    reserved: int
    meta: str = ""
    until: float = 0.0  # its lease's end: past it, unsettled, the sweep claims it
    checkpoint: Checkpoint | None = None
    admitted_at: float | None = None  # its admission's time (admit.lua's `a`)


@dataclass
class _Refusal:
    """The limits that refuse one request: the one with the longest wait names the denial
    and its wait is the retry (the first of equal waits, in the order checked); a limit no
    wait satisfies (reservation larger than it) overrides both."""

    tier: TierLimit | None = None
    limit: str = ""
    value: float | None = None
    wait: float = 0.0
    never: bool = False
    own: dict[int, tuple[Tightest, Tightest, dict[str, tuple[int, float, float]]]] = field(
        default_factory=dict)

    def refuse(self, tier: TierLimit, limit: str, value: float, wait: float | None) -> None:
        if self.never:
            return
        if wait is None:
            self.tier, self.limit, self.value, self.never = tier, limit, value, True
            return
        if self.tier is None or wait > self.wait:
            self.tier, self.limit, self.value, self.wait = tier, limit, value, wait

    def numbers(self, tier: TierLimit, rq: Tightest, tk: Tightest,
                refused: dict[str, tuple[int, float, float]]) -> None:
        """A tier's own numbers as they stand, should it be the one that says no (or fill a
        family that one lacks): its rps, its tightest token window and each token window
        that refused it, by kind."""
        self.own[id(tier)] = (rq, tk, refused)

    def verdict(self) -> Refused:
        """The refusing tier's own numbers; a family it has no limit for is the tightest
        of every tier that has one (as an allowed answer picks it), else absent."""
        assert self.tier is not None
        rq, tk, refused = self.own[id(self.tier)]
        if self.limit == CONCURRENCY:
            rq = Tightest(int(self.value or 0), 0, 1.0)
        if self.limit in refused:
            tk = Tightest()
            tk.offer(*refused[self.limit])
        if rq.limit is None:
            rq = self._tightest([own[0] for own in self.own.values()])
        if tk.limit is None:
            tk = self._tightest([own[1] for own in self.own.values()])
        rate = RateInfo(rq.limit, rq.remaining, rq.reset, tk.limit, tk.remaining, tk.reset)
        return Refused(self.tier.tier, self.limit, self.value, 0.0 if self.never else self.wait,
                       rate, impossible=self.never)

    @staticmethod
    def _tightest(tiers: list[Tightest]) -> Tightest:
        """Of the tiers' own numbers for one family, the fewest remaining."""
        best = Tightest()
        for t in tiers:
            if t.limit is not None and t.remaining is not None and t.reset is not None:
                best.offer(t.limit, t.remaining, t.reset)
        return best


@dataclass
class MemoryLimiter(Limiter, AllowanceStore):
    lease_ttl: float = 60.0
    start_ttl: float | None = None  # the first lease, until renewed (default: lease_ttl)
    tat: dict[str, float] = field(default_factory=dict)
    leases: dict[str, dict[str, float]] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    held: dict[str, _Held] = field(default_factory=dict)
    # This spoke's allowances of global quotas ('tpd|tpmo:<tier>:<name>:<period id>')
    allowances: dict[str, int] = field(default_factory=dict)
    allowance_gen: int = 0
    pruned_at: int = -1  # the minute the token windows were last pruned (_prune)

    async def admit(self, req: AdmitRequest) -> Verdict:
        return self.admit_now(req)

    def admit_now(self, req: AdmitRequest) -> Verdict:
        """Every tier is scanned, even past a denial (which commits nothing), as in
        admit.lua: the retry is the longest wait of every limit that refuses now."""
        now = req.now
        if req.request_id in self.held:
            return DuplicateId()
        minute = maths.minute_index(now)
        if minute > self.pruned_at:
            self._prune(now, minute)
        rq, tk = Tightest(), Tightest()
        writes: list[tuple[TierLimit, float | None, list[str]]] = []
        no = _Refusal()
        for t in req.tiers:
            key, s = f"{t.tier}:{t.name}", t.spec
            own_rq, own_tk = Tightest(), Tightest()
            denied_tk: dict[str, tuple[int, float, float]] = {}
            new_tat = None
            if s.rps is not None and s.burst is not None:
                g = maths.gcra(self.tat.get(key, 0.0), now, s.rps, s.burst)
                if not g.allowed:
                    no.refuse(t, RPS, s.rps, g.retry_after)
                    own_rq.offer(s.burst, 0, g.reset)
                else:
                    new_tat = g.new_tat
                    rq.offer(s.burst, g.remaining, g.reset)
                    own_rq.offer(s.burst, g.remaining + 1, g.reset - 1 / s.rps)
            if s.concurrency is not None and len(self._live(key, now)) >= s.concurrency:
                no.refuse(t, CONCURRENCY, s.concurrency, 1.0)
            token_keys = []
            for kind, limit, wkey, prev, cur in self._windows(key, t, now, minute):
                if limit is None or not req.tokens:  # not req.tokens: none applies
                    continue
                used = maths.sliding_minute(prev, cur, now) if kind == TPM else cur
                if kind == TPM:
                    wait = maths.sliding_wait(prev, cur, now, req.reserve, limit)
                    reset = maths.sliding_reset(prev, cur, now)
                    tk.offer(limit, limit - used - req.reserve,
                             maths.sliding_reset(prev, cur + req.reserve, now))
                else:
                    reset = self._period_end(kind, now)
                    # larger than the whole limit: never (but an allowance may grow)
                    never = req.reserve > limit and kind not in (GTPD, GTPMO)
                    wait = None if never else reset
                    tk.offer(limit, limit - used - req.reserve, reset)
                mine = (limit, limit - used, reset)
                if not maths.fits(used, req.reserve, limit):
                    no.refuse(t, kind, limit, wait)
                    denied_tk[kind] = mine
                own_tk.offer(*mine)
                token_keys.append(wkey)
            no.numbers(t, own_rq, own_tk, denied_tk)
            writes.append((t, new_tat, token_keys))
        if no.tier is not None:
            return no.verdict()
        return self._commit(req, writes, rq, tk)

    def _windows(
        self, key: str, t: TierLimit, now: float, minute: int
    ) -> list[tuple[str, int | None, str, float, float]]:
        """(kind, limit, counter key, previous minute's count, this window's count)."""
        s = t.spec
        cur = f"tpm:{key}:{minute}"
        day_id, month_id = maths.day_id(now), maths.month_id(now)
        day, month = f"tpd:{key}:{day_id}", f"tpmo:{key}:{month_id}"
        out = [
            (TPM, s.tokens_per_minute, cur, self.tokens.get(f"tpm:{key}:{minute - 1}", 0),
             self.tokens.get(cur, 0)),
            (TPD, s.tokens_per_day, day, 0.0, self.tokens.get(day, 0)),
            (TPMO, s.tokens_per_month, month, 0.0, self.tokens.get(month, 0)),
        ]
        if s.global_tokens_per_day is not None:  # this spoke's allowance, else the fallback
            g = f"gtpd:{key}:{day_id}"
            limit = self.allowances.get(f"tpd:{key}:{day_id}",
                                        maths.fallback_allowance(s.global_tokens_per_day))
            out.append((GTPD, limit, g, 0.0, self.tokens.get(g, 0)))
        if s.global_tokens_per_month is not None:
            g = f"gtpmo:{key}:{month_id}"
            limit = self.allowances.get(f"tpmo:{key}:{month_id}",
                                        maths.fallback_allowance(s.global_tokens_per_month))
            out.append((GTPMO, limit, g, 0.0, self.tokens.get(g, 0)))
        return out

    def _prune(self, now: float, minute: int) -> None:
        """Forget the token windows Redis would have let expire (admit.lua's TTLs: a minute's
        after 2 minutes, a day's after 2 days, a month's after 40 days): a long-running
        embedded gateway would otherwise keep every minute of every tier it ever counted."""
        self.pruned_at = minute
        day, month = maths.day_id(now - 2 * maths.DAY), maths.month_id(now - 40 * maths.DAY)
        for k in list(self.tokens):
            kind, period = k.partition(":")[0], k.rpartition(":")[2]
            if kind == "tpm":
                stale = int(period) < minute - 2
            else:  # tpd, gtpd: a day id; tpmo, gtpmo: a month id (both sort as they run)
                stale = period < (day if kind.endswith("d") else month)
            if stale:
                del self.tokens[k]

    @staticmethod
    def _period_end(kind: str, now: float) -> float:
        return (maths.seconds_to_day_end(now) if kind in (TPD, GTPD)
                else maths.seconds_to_month_end(now))

    def _live(self, key: str, now: float) -> dict[str, float]:
        live = self.leases.setdefault(key, {})
        for rid in [r for r, exp in live.items() if exp <= now]:
            del live[rid]
        return live

    def _commit(
        self,
        req: AdmitRequest,
        writes: list[tuple[TierLimit, float | None, list[str]]],
        rq: Tightest,
        tk: Tightest,
    ) -> Admitted:
        lease_keys, token_keys = [], []
        for t, new_tat, tkeys in writes:
            key = f"{t.tier}:{t.name}"
            if new_tat is not None:
                self.tat[key] = new_tat
            if t.spec.concurrency is not None:
                self.leases.setdefault(key, {})[req.request_id] = req.now + first_lease(
                    self.lease_ttl, self.start_ttl)
                lease_keys.append(key)
            for wk in tkeys:
                self.tokens[wk] = self.tokens.get(wk, 0) + req.reserve
            token_keys += tkeys
        leased = bool(lease_keys or token_keys)
        if leased:
            self.held[req.request_id] = _Held(
                lease_keys, token_keys, req.reserve, req.meta,
                req.now + first_lease(self.lease_ttl, self.start_ttl), admitted_at=req.now)
        rate = RateInfo(rq.limit, rq.remaining, rq.reset, tk.limit, tk.remaining, tk.reset)
        return Admitted(rate, owes_settlement=leased)

    async def end_many(self, ends: Sequence[Ending]) -> None:
        for end in ends:
            if isinstance(end, Release):
                held = self.held.get(end.request_id)
                for key in held.lease_keys if held else []:
                    self.leases.get(key, {}).pop(end.request_id, None)
            elif isinstance(end, Settle):
                self._settle(end.request_id, end.actual_tokens)
            elif isinstance(end, Abandon):
                if (held := self.held.get(end.request_id)) is not None:
                    held.until = 0.0
            else:  # Void: one process, so no admission can commit after its void
                self._settle(end.request_id, 0)

    def _settle(self, request_id: str, actual_tokens: int | None) -> None:
        held = self.held.pop(request_id, None)
        if held is None:
            return
        for key in held.lease_keys:
            self.leases.get(key, {}).pop(request_id, None)
        if actual_tokens is not None:
            delta = max(actual_tokens, 0) - held.reserved
            for wk in held.token_keys:
                self.tokens[wk] = max(0.0, self.tokens.get(wk, 0) + delta)

    async def renew(self, request_ids: list[str], now: float,
                    checkpoints: Mapping[str, Checkpoint] | None = None) -> list[str]:
        gone = []
        for rid in request_ids:
            held = self.held.get(rid)
            if held is None:
                gone.append(rid)
                continue
            held.until = now + self.lease_ttl
            if checkpoints and rid in checkpoints:
                held.checkpoint = checkpoints[rid]
            for key in held.lease_keys:
                live = self.leases.get(key, {})
                if rid in live:
                    live[rid] = now + self.lease_ttl
        return gone

    async def counters(self, tier_key: str, now: float) -> Counters:
        """One tier's counters ("team:team-a"), as `RedisLimiter.counters` reads Redis's."""
        minute = maths.minute_index(now)
        t, a = self.tokens, self.allowances
        day, month = f"{tier_key}:{maths.day_id(now)}", f"{tier_key}:{maths.month_id(now)}"
        return Counters(
            self.tat.get(tier_key, 0.0), len(self._live(tier_key, now)),
            t.get(f"tpm:{tier_key}:{minute - 1}", 0.0), t.get(f"tpm:{tier_key}:{minute}", 0.0),
            t.get(f"tpd:{day}", 0.0), t.get(f"tpmo:{month}", 0.0),
            t.get(f"gtpd:{day}", 0.0), t.get(f"gtpmo:{month}", 0.0),
            a.get(f"tpd:{day}"), a.get(f"tpmo:{month}"))

    def in_flight(self, tier: str, name: str, now: float) -> int:
        return len(self._live(f"{tier}:{name}", now))

    async def apply_allowances(self, generation: int,
                               entries: Sequence[Allowance]) -> list[Applied] | None:
        """As allowances.lua: an older generation is refused; never below what is used,
        the counter raised to the use the allocator knows, plus the reservations in flight
        in it, where below."""
        if generation < self.allowance_gen:
            return None
        self.allowance_gen = generation
        out = []
        for e in entries:
            w = PERIOD_WINDOW[e.period]
            counter = f"g{w}:{e.scope}:{e.period_id}"
            used = int(self.tokens.get(counter, 0))
            if used < e.known:  # plus the reservations in flight it holds, no event's yet
                self.tokens[counter] = used = e.known + sum(
                    h.reserved for h in self.held.values() if counter in h.token_keys)
            tokens = self.allowances[f"{w}:{e.scope}:{e.period_id}"] = max(e.tokens, used)
            out.append(Applied(e.scope, e.period, e.period_id, tokens, used))
        return out

    async def allowance_generation(self) -> int:
        return self.allowance_gen

    async def sweep(self, now: float, limit: int = 100) -> list[Orphan]:
        """Admissions whose end nobody reported (one process: a crash takes these counters
        with it, but a record Envoy lost does not): freed, billed their checkpoint."""
        out = []
        for rid in [r for r, h in self.held.items() if h.until <= now][:limit]:
            held = self.held[rid]
            ck = held.checkpoint
            # its weighted count when it has one (sweep.lua's third field), else its tokens
            charged = (ck[2] if len(ck) > 2 else ck[0] + ck[1]) if ck else 0
            self._settle(rid, charged)
            out.append(Orphan(rid, held.meta, charged, (ck[0], ck[1]) if ck else None,
                              (ck[3], ck[4]) if ck and len(ck) > 4 else (0, 0),
                              admitted_at=held.admitted_at))
        return out

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
