"""What the limiter is asked and what it answers; the `Limiter` protocol both stores implement."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.limits.standing import Counters
from gateway.policy.model import TierLimit

# Which limit tripped, in the order they are checked within a tier.
RPS, CONCURRENCY, TPM, TPD, TPMO = "rps", "concurrency", "tokens_per_minute", "tokens_per_day", \
    "tokens_per_month"
# This spoke's allowance of a quota shared by all spokes (DESIGN §10), checked after the rest.
GTPD, GTPMO = "global_tokens_per_day", "global_tokens_per_month"
# A ticket (gateway/limits/ahead.py) refused because it would leave a limit nearly used up.
HEADROOM = "headroom"
# A ticket's id starts with this: an admission made ahead of its request, never a request
# (a request id cannot hold a control character: Envoy refuses one in a header).
TICKET = "\x1e"


def first_lease(lease_ttl: float, start_ttl: float | None) -> float:
    """How long an admission holds its slots before its ext_proc stream renews them: the
    start TTL, never longer than the lease TTL (default: the lease TTL)."""
    return min(start_ttl or lease_ttl, lease_ttl)


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    request_id: str
    tiers: tuple[TierLimit, ...]
    reserve: int  # tokens reserved at admission, replaced by the actual count at settlement
    now: float
    meta: str = ""  # who and what (opaque to the store), for an orphaned request's event
    # False: no token window applies (an endpoint that reserves and bills no tokens by its
    # nature, count_tokens): only rps and concurrency are checked and committed. A request
    # that merely reserves 0 (max_tokens 0, no prompt) is still held to its token windows.
    tokens: bool = True


# A request's usage so far, checkpointed with its lease (the orphan sweep bills it):
# (prompt, completion) tokens, and, for a model with token weights only, the weighted count
# its token limits are charged (gateway/token_weights.py), then, when it has any, the
# prompt's cached and cache-creation tokens (so an orphan's event counts what the sweep
# charged); without weights, prompt + completion.
Checkpoint = tuple[int, int] | tuple[int, int, int] | tuple[int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class Orphan:
    """An admitted request nobody settled: its sidecar died, or its client left before
    ext_proc saw it. Its reservation is replaced by its last checkpoint's tokens (`charged`:
    weighted, for a model with token weights), or cancelled (0) when it has none."""

    request_id: str
    meta: str
    charged: int
    checkpoint: tuple[int, int] | None = None  # (prompt, completion) seen at the last renewal
    cache: tuple[int, int] = (0, 0)  # (cached, cache-creation) of that prompt (weighted only)
    lost: bool = False  # its record expired before any sweep: nothing to bill it from
    # When it was admitted (epoch s): its event's start. None: its record does not say (an
    # older sidecar wrote it), and its event starts at the sweep's time.
    admitted_at: float | None = None


@dataclass(frozen=True, slots=True)
class RateInfo:
    """The tightest tier's numbers, for the OpenAI-style x-ratelimit-* headers (None = no limit)."""

    req_limit: int | None = None
    req_remaining: int | None = None
    req_reset: float | None = None
    tok_limit: int | None = None
    tok_remaining: int | None = None
    tok_reset: float | None = None


# What the store answers an admission: one of four verdicts (`Verdict`).
@dataclass(frozen=True, slots=True)
class Admitted:
    """Every tier let it through, and it is committed in all of them."""

    rate: RateInfo = RateInfo()
    # The store holds something of it (a concurrency slot, a token reservation): its end
    # is owed to the store (released, settled), else its lease runs out to the orphan sweep.
    owes_settlement: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """A limit said no; nothing was committed at any tier."""

    tier: str  # 'model' | 'team' | 'key': the tier that said no
    limit: str  # which of its limits (RPS, CONCURRENCY, TPM, ...)
    limit_value: float | None
    retry_after: float = 0.0
    rate: RateInfo = RateInfo()
    # the reservation is larger than the whole limit: no wait will ever admit it
    impossible: bool = False


@dataclass(frozen=True, slots=True)
class Voided:
    """Its caller gave up before the store answered, and voided it: nothing was committed.
    Meant for nobody; a client sees it only by reusing that request id within minutes."""


@dataclass(frozen=True, slots=True)
class DuplicateId:
    """Another request with this id is in flight: two live requests never share an admission
    (its slots, its reservation, its usage event), whatever ids a client chooses."""


Verdict = Admitted | Refused | Voided | DuplicateId


# How an admission ends: what `Limiter.end_many` is given, in order, one store call a batch
# (the Redis store splits a large one).
@dataclass(frozen=True, slots=True)
class Release:
    """The response ended: free its concurrency slots now (its settlement follows)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Settle:
    """Free what is still held and replace the reservation with `actual_tokens` (None =
    unknown: keep the reservation). Idempotent: a second settlement changes nothing."""

    request_id: str
    actual_tokens: int | None


@dataclass(frozen=True, slots=True)
class Void:
    """Undo an admission whose caller gave up waiting: whatever the store committed, or
    commits later, is released and charged nothing."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Abandon:
    """Nobody will report this request's end (its record was lost or unreadable): hand it to
    the orphan sweep now, which frees it and bills its last checkpoint."""

    request_id: str


Ending = Release | Settle | Void | Abandon


class Limiter(Protocol):
    """Admission store. Redis for a spoke, in-process for the embedded mode.

    `admit` checks every tier and commits all of them or none: a request denied at one
    tier consumes nothing at another. Raises StoreUnavailable if the store cannot answer,
    and its StoreInDoubt if the admission was sent but not answered (past the store's
    deadline, or the connection died): it may have committed, so the caller voids it.
    """

    async def admit(self, req: AdmitRequest) -> Verdict: ...

    async def end_many(self, ends: Sequence[Ending]) -> None:
        """Apply several endings, in order, in one store call."""
        ...

    async def release(self, request_id: str) -> None:
        await self.end_many([Release(request_id)])

    async def settle(self, request_id: str, actual_tokens: int | None) -> None:
        await self.end_many([Settle(request_id, actual_tokens)])

    async def void(self, request_id: str) -> None:
        await self.end_many([Void(request_id)])

    async def renew(self, request_ids: list[str], now: float,
                    checkpoints: Mapping[str, Checkpoint] | None = None) -> list[str]:
        """Extend the leases of requests still streaming, keeping each one's usage so far
        (`checkpoints`: prompt, completion[, weighted]) for the orphan sweep; return those
        that hold
        nothing any more (settled, perhaps by another instance): stop renewing them."""
        ...

    async def sweep(self, now: float, limit: int = 100) -> list[Orphan]:
        """Claim (once, across instances) requests whose lease expired unsettled."""
        ...

    async def counters(self, tier_key: str, now: float) -> Counters:
        """One tier's counters ("team:team-a") as admission reads them (`keys show`)."""
        ...

    async def ping(self) -> bool: ...

    async def ping_failure(self) -> str:
        """Why the store does not answer a ping ("" when it does), for the operator's log
        (`limiter_store_unreachable`): a store whose `ping` swallows its error says it."""
        return "" if await self.ping() else "the ping was refused"

    async def close(self) -> None: ...
