"""Redis limiter: one Lua call decides a whole batch of admissions.

Admissions that arrive while a call is in flight queue up and go together in the next
call, so under load many Checks share one round trip (and one Lua invocation), while a
lone request never waits. Every Redis failure becomes StoreUnavailable here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from gateway import batching
from gateway.errors import RedisLost, StoreInDoubt, StoreUnavailable
from gateway.limits import maths, standing
from gateway.limits.resp import RedisReplyError, RespClient, Script
from gateway.limits.standing import Counters
from gateway.limits.types import (
    CONCURRENCY,
    GTPD,
    GTPMO,
    HEADROOM,
    RPS,
    TICKET,
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
    Verdict,
    Void,
    Voided,
    first_lease,
)
from gateway.policy.model import TierLimit

REDIS_ERRORS = (RedisReplyError, OSError, asyncio.TimeoutError)  # RedisGone is an OSError
MAX_BATCH = 256
# admit.lua's answer codes: 0 admitted, a limit's code, or one of these two.
LIMIT_CODES = {1: RPS, 2: CONCURRENCY, 3: TPM, 4: TPD, 5: TPMO, 7: GTPD, 8: GTPMO,
               10: HEADROOM}
VOIDED_CODE, DUPLICATE_CODE = 6, 9
# How long an admission's record (gw:req:<id>) outlives its last write, at least. The orphan
# sweep bills an admission from its record; with no record the sweep takes the id out of
# gw:reqs and returns nothing: no usage event, and its reservation stays on the counters.
# A sweep runs in every sidecar every third of a lease, but none runs while every sidecar
# of the spoke is down (a crash loop's back-off, a restart on a loaded machine): three
# leases were once all the record had, and a killed sidecar that took more than two leases
# to come back lost its streams' events. Every record is in gw:reqs until a settlement or
# a sweep deletes it, so this TTL only bounds a leak; a day outlasts any outage.
RECORD_KEEP_MS = 86_400_000


def _lua(name: str) -> str:
    return resources.files("gateway.limits").joinpath(name).read_text()


def _opt(v: float | int | None) -> str | float | int:
    return "" if v is None else v


def _fallback(quota: int | None) -> int | None:
    return None if quota is None else maths.fallback_allowance(quota)


def _none(v: int) -> int | None:
    return None if v < 0 else v


def _admission_failed(exc: BaseException) -> StoreUnavailable:
    """An admission call that failed: in doubt if it was sent and then the connection died
    (it may have committed: the caller voids it), else plainly unavailable."""
    kind = StoreInDoubt if isinstance(exc, RedisLost) else StoreUnavailable
    return kind(f"redis: {exc.__class__.__name__}: {exc}")


def _settle_code(end: Ending) -> int:
    """settle.lua's `actual_tokens`: a count, -1 keep the reservation, -2 void, -3 release,
    -4 abandon (to the sweep)."""
    if isinstance(end, Release):
        return -3
    if isinstance(end, Void):
        return -2
    if isinstance(end, Abandon):
        return -4
    return -1 if end.actual_tokens is None else max(end.actual_tokens, 0)


class RedisLimiter(Limiter):
    def __init__(self, redis: RespClient, lease_ttl: float = 60.0,
                 start_ttl: float | None = None, deadline: float = 0.25,
                 orphan_grace: float = 0.0) -> None:
        self.redis = redis
        # An admission not answered within `deadline` fails with StoreInDoubt (fail closed).
        self._deadlines = batching.Deadlines(deadline, lambda: StoreInDoubt(
            f"redis: no answer within {deadline * 1000:g} ms (timed out)"))
        self.lease_ttl_ms = int(lease_ttl * 1000)
        self.start_ttl_ms = int(first_lease(lease_ttl, start_ttl) * 1000)
        # An admission's record outlives its lease until the orphan sweep can claim it.
        self.record_ttl_ms = max(self.lease_ttl_ms * 3 + int(orphan_grace * 1000),
                                 RECORD_KEEP_MS)
        self._admit = Script(redis, _lua("admit.lua"))
        self._settle = Script(redis, _lua("settle.lua"))
        self._renew = Script(redis, _lua("renew.lua"))
        self._sweep = Script(redis, _lua("sweep.lua"))
        self._bind = Script(redis, _lua("bind.lua"))
        self._queue: list[tuple[AdmitRequest, asyncio.Future[Verdict]]] = []
        self._pump: asyncio.Task[None] | None = None
        self._tier_args: dict[int, tuple[tuple[TierLimit, ...], str]] = {}

    async def admit(self, req: AdmitRequest) -> Verdict:
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._deadlines.add(fut)
        self._queue.append((req, fut))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        """Send queued admissions, one Lua call per batch, until the queue is empty.

        Checks that arrive together join one call (~10 % less CPU per Check at c=64)."""
        await batching.gather(lambda: len(self._queue))
        while self._queue:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            live = [(r, f) for r, f in batch if not f.done()]  # skip callers that timed out
            if not live:
                continue
            try:
                rows = await self._admit(*self._args([r for r, _ in live]))
            except REDIS_ERRORS as exc:
                err = _admission_failed(exc)
                for _, f in live:
                    if not f.done():
                        f.set_exception(err)
                continue
            for (req, f), row in zip(live, rows, strict=True):
                if not f.done():
                    f.set_result(self._verdict(req, row))

    def _args(self, reqs: list[AdmitRequest]) -> list[Any]:
        now = reqs[0].now
        args: list[Any] = [
            int(now * 1000), self.start_ttl_ms, self.record_ttl_ms,
            maths.day_id(now), maths.month_id(now),
            int(maths.seconds_to_day_end(now) * 1000),
            int(maths.seconds_to_month_end(now) * 1000),
            len(reqs),
        ]
        for r in reqs:  # one \x1f-joined argument per request (admit.lua splits it)
            reserve = r.reserve if r.tokens else -1  # -1: no token window applies
            args.append(f"{r.request_id}\x1f{reserve}\x1f{r.meta}\x1f{self._tiers_arg(r.tiers)}")
        return args

    def _tiers_arg(self, tiers: tuple[TierLimit, ...]) -> str:
        """The tiers' part of the argument; the policy hands out the same tuple for every
        request of a (model, key), so it is built once per policy revision."""
        cached = self._tier_args.get(id(tiers))
        if cached is not None and cached[0] is tiers:
            return cached[1]
        fields: list[Any] = [len(tiers)]
        for t in tiers:
            sp = t.spec
            fields += [f"{t.tier}:{t.name}", _opt(sp.rps), _opt(sp.burst), _opt(sp.concurrency),
                       _opt(sp.tokens_per_minute), _opt(sp.tokens_per_day),
                       _opt(sp.tokens_per_month), _opt(_fallback(sp.global_tokens_per_day)),
                       _opt(_fallback(sp.global_tokens_per_month))]
        arg = "\x1f".join(map(str, fields))
        if len(self._tier_args) >= 65536:
            self._tier_args.clear()
        self._tier_args[id(tiers)] = (tiers, arg)  # holding `tiers` keeps its id unique
        return arg

    @staticmethod
    def _verdict(req: AdmitRequest, row: list[int]) -> Verdict:
        code, at, retry_ms, rl, rr, rreset, tl, tr, treset, leased = (int(v) for v in row)
        rate = RateInfo(
            _none(rl), _none(rr), rreset / 1000 if rreset >= 0 else None,
            _none(tl), _none(tr), treset / 1000 if treset >= 0 else None,
        )
        if code == 0:
            return Admitted(rate, owes_settlement=bool(leased))
        if code == VOIDED_CODE:
            return Voided()
        if code == DUPLICATE_CODE:
            return DuplicateId()
        limit = LIMIT_CODES[code]
        tier = req.tiers[at - 1]
        # A global quota's denial names the allowance this spoke enforced, not the quota.
        value = rate.tok_limit if limit in (GTPD, GTPMO) else getattr(tier.spec, limit, None)
        return Refused(tier.tier, limit, value, max(retry_ms, 0) / 1000, rate,
                       impossible=retry_ms < 0)

    async def admit_now(self, req: AdmitRequest) -> Verdict:
        """One admission in a call of its own, written at once: no batching, no deadline (a
        ticket's, right behind the bind it follows; no Check waits on it)."""
        try:
            rows = await self._admit(*self._args([req]))
        except REDIS_ERRORS as exc:
            raise _admission_failed(exc) from exc
        return self._verdict(req, rows[0])

    async def bind(self, ticket_id: str, req: AdmitRequest) -> int:
        """Make a ticket `req`'s admission (bind.lua): 1 bound, 0 the ticket is gone, -1
        the request id is live already. Sent on the connection the ticket's admission and
        the request's later settlement use, so Redis runs them in that order."""
        try:
            return int(await self._bind(ticket_id, req.request_id, req.reserve, req.meta,
                                        int(req.now * 1000)))
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    def answering(self) -> object | None:
        """The connection admissions go on while it has not failed, else None: a ticket
        admitted on one is good only while that same connection lives."""
        return self.redis.live_connection()

    async def end_many(self, ends: Sequence[Ending]) -> None:
        """Settle in calls of at most MAX_BATCH, one after another: what piled up while the
        store was away must not hold Redis (and every admission waiting on it) in one
        script. A call that fails after others went through is retried whole by the
        ledger; settling is idempotent."""
        try:
            for i in range(0, len(ends), MAX_BATCH):
                part = ends[i:i + MAX_BATCH]
                args: list[Any] = [len(part)]
                for end in part:
                    args += [end.request_id, _settle_code(end)]
                await self._settle(*args)
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def renew(self, request_ids: list[str], now: float,
                    checkpoints: Mapping[str, Checkpoint] | None = None) -> list[str]:
        if not request_ids:
            return []
        ck = checkpoints or {}
        args = [f"{rid}\x1f{_renewal(ck[rid])}" if rid in ck else rid for rid in request_ids]
        # At most MAX_BATCH ids a call (~1.5 ms of Redis), each answered before the next is
        # sent: renewing thousands of live streams in one script held Redis past the
        # admission deadline (~6 us an id: 5,000 streams, 31 ms; 50,000, a burst of 503s).
        gone: list[Any] = []
        try:
            for i in range(0, len(args), MAX_BATCH):
                gone += await self._renew(int(now * 1000), self.lease_ttl_ms,
                                          self.record_ttl_ms, *args[i:i + MAX_BATCH]) or ()
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        return [g.decode() if isinstance(g, bytes) else str(g) for g in gone]

    async def sweep(self, now: float, limit: int = 100) -> list[Orphan]:
        try:
            flat = await self._sweep(int(now * 1000), limit)
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        dec = [v.decode() if isinstance(v, bytes) else v for v in flat]
        # Six a claim (sweep.lua). A ticket nobody took (its sidecar died holding it) is
        # freed with no event: no request existed.
        return [Orphan(str(dec[i]), str(dec[i + 1]), max(0, int(dec[i + 2])),
                       _checkpoint(dec[i + 3]), _cache(dec[i + 4]),
                       lost=int(dec[i + 2]) < 0, admitted_at=_admitted(dec[i + 5]))
                for i in range(0, len(dec), 6) if not str(dec[i]).startswith(TICKET)]

    async def counters(self, tier_key: str, now: float) -> Counters:
        """One tier's counters as admission reads them (for `keys show`; not atomic across
        them, which a report of where a tier stands does not need)."""
        rps, conc, prev, cur, day, month = standing.redis_keys(tier_key, now)
        now_ms = int(now * 1000)
        try:
            tat, live = await self.redis.call("GET", rps), await self.redis.call(
                "ZCOUNT", conc, f"({now_ms}", "+inf")
            counts = [await self.redis.call("GET", k) for k in (prev, cur, day, month)]
            gday, gmonth, aday, amonth = [await self.redis.call("GET", k) for k in
                                          standing.redis_global_keys(tier_key, now)]
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        p, c, d, m = (float(v or 0) for v in counts)
        return Counters(float(tat or 0) / 1000, int(live or 0), p, c, d, m,
                        float(gday or 0), float(gmonth or 0), _held(aday), _held(amonth))

    async def ping(self) -> bool:
        """Whether the store answers; under Sentinel, also leaves a demoted primary (the
        app pings every second)."""
        return not await self.ping_failure()

    async def ping_failure(self) -> str:
        """`ping`, saying why not: the connection's error (its address, errno), or the
        reply that was not PONG; "" when the store answers."""
        with contextlib.suppress(*REDIS_ERRORS):  # Sentinels away: the primary may answer
            await self.redis.follow()
        try:
            reply = await self.redis.call("PING")
        except REDIS_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}"
        return "" if reply == b"PONG" else f"PING answered {reply!r}"

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        await self.redis.close()


def _renewal(ck: Checkpoint) -> str:
    """A checkpoint as renew.lua takes it: "prompt:completion", stored as `u` as it always
    was; for a model with token weights "prompt:completion:weighted", then, after \x1f, the
    prompt's "cached:created" tokens ("0:0" for none), stored as `k`. `u` keeps the format
    every sidecar's sweep.lua reads (an older one sweeps this one's records during an
    upgrade): what it lacks goes in a field of its own, which an older sweep ignores."""
    if len(ck) == 2:
        return f"{ck[0]}:{ck[1]}"
    cache = f"{ck[3]}:{ck[4]}" if len(ck) == 5 else "0:0"
    return f"{ck[0]}:{ck[1]}:{ck[2]}\x1f{cache}"


def _checkpoint(raw: object) -> tuple[int, int] | None:
    """A checkpoint's (prompt, completion), `u`: "prompt:completion[:weighted]" as
    renew.lua stored it (the weighted count is sweep.lua's, for `charged`)."""
    parts = str(raw or "").split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _cache(raw: object) -> tuple[int, int]:
    """A weighted checkpoint's (cached, cache-creation) prompt tokens, `k`: "cached:created";
    (0, 0) if none (a record of an older sidecar has no `k`)."""
    parts = str(raw or "").split(":")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        return int(parts[0]), int(parts[1])
    return 0, 0


def _admitted(raw: object) -> float | None:
    """The admission's time (epoch seconds) from `a`, epoch ms; None if the record has
    none (an older sidecar's)."""
    text = str(raw or "")
    return int(text) / 1000 if text.isdigit() else None


def _held(allowance: Any) -> float | None:
    """An allowance as GET returns it; nil: none held."""
    return float(allowance) if allowance is not None else None
