"""Runtime policy: the schema compiled into frozen lookups the request path can read in O(1).

A `Policy` is immutable; a new revision is a new object swapped in atomically
(one attribute assignment), so a request never sees half of two revisions.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, replace

from gateway.policy.billing_rules import DEFAULT_CANCEL_RULE, CancelRule
from gateway.policy.prices import PriceBook, Rates
from gateway.policy.schema import GlobalLimits, Limits, PolicyDoc
from gateway.routes import PassThrough
from gateway.token_weights import TokenWeights

TIERS = ("model", "team", "key")


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """One tier's limits; None = unlimited. The global ones are quotas for all spokes
    together: the spoke enforces its allowance of each (DESIGN §10)."""

    rps: float | None = None
    burst: int | None = None
    concurrency: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    global_tokens_per_day: int | None = None
    global_tokens_per_month: int | None = None

    @classmethod
    def of(cls, limits: Limits, global_limits: GlobalLimits | None = None) -> LimitSpec:
        g = global_limits or GlobalLimits()
        return cls(
            rps=limits.rps,
            burst=limits.effective_burst,
            concurrency=limits.concurrency,
            tokens_per_minute=limits.tokens_per_minute,
            tokens_per_day=limits.tokens_per_day,
            tokens_per_month=limits.tokens_per_month,
            global_tokens_per_day=g.tokens_per_day,
            global_tokens_per_month=g.tokens_per_month,
        )

    @property
    def empty(self) -> bool:
        return (
            self.rps is None
            and self.concurrency is None
            and self.tokens_per_minute is None
            and self.tokens_per_day is None
            and self.tokens_per_month is None
            and not self.has_global
        )

    @property
    def has_global(self) -> bool:
        return self.global_tokens_per_day is not None or self.global_tokens_per_month is not None

    @property
    def has_tokens(self) -> bool:
        return not (
            self.tokens_per_minute is None
            and self.tokens_per_day is None
            and self.tokens_per_month is None
            and not self.has_global
        )


@dataclass(frozen=True, slots=True)
class TierLimit:
    """A tier that names at least one limit: ('team', 'team-a', spec)."""

    tier: str
    name: str
    spec: LimitSpec


class ModelAcl:
    """Glob patterns compiled once into one regex; answers cached per model name."""

    __slots__ = ("_cache", "_rx", "patterns")

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = tuple(patterns)
        rx = "|".join(f"(?:{fnmatch.translate(p)})" for p in patterns) or r"(?!)"
        self._rx = re.compile(rx)
        self._cache: dict[str, bool] = {}

    def allows(self, model: str) -> bool:
        hit = self._cache.get(model)
        if hit is None:
            hit = self._rx.fullmatch(model) is not None
            if len(self._cache) < 4096:
                self._cache[model] = hit
        return hit


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    team: str
    team_acl: ModelAcl
    key_acl: ModelAcl | None
    limits: LimitSpec
    expires_at: float | None
    disabled: bool
    cancelled: CancelRule = DEFAULT_CANCEL_RULE  # its team's rule for client-cancelled streams
    # The GIE InferenceObjective its requests name (x-gateway-inference-objective): its own,
    # else its team's; "" = none.
    inference_objective: str = ""

    def may_use(self, model: str) -> bool:
        """The key narrows the team's ACL, never widens it: both must allow."""
        if not self.team_acl.allows(model):
            return False
        return self.key_acl is None or self.key_acl.allows(model)


@dataclass(frozen=True)
class Policy:
    revision: int
    doc: PolicyDoc
    models: dict[str, LimitSpec]
    teams: dict[str, LimitSpec]
    keys_by_digest: dict[bytes, KeyRecord]
    keys: dict[str, KeyRecord] = field(default_factory=dict)
    passthrough: tuple[PassThrough, ...] = ()
    prices: dict[str, PriceBook] = field(default_factory=dict, compare=False)  # from doc
    # The models with token weights other than all 1 (from doc); the rest count raw tokens
    weights: dict[str, TokenWeights] = field(default_factory=dict, compare=False)
    _tiers: dict[tuple[str | None, str], tuple[TierLimit, ...]] = field(
        default_factory=dict, compare=False, repr=False)

    @classmethod
    def compile(cls, doc: PolicyDoc, revision: int) -> Policy:
        teams = {name: LimitSpec.of(t.limits, t.global_limits) for name, t in doc.teams.items()}
        team_acls = {name: ModelAcl(t.models) for name, t in doc.teams.items()}
        keys: dict[str, KeyRecord] = {}
        by_digest: dict[bytes, KeyRecord] = {}
        for key_id, k in doc.keys.items():
            rec = KeyRecord(
                key_id=key_id,
                team=k.team,
                team_acl=team_acls[k.team],
                key_acl=ModelAcl(k.models) if k.models is not None else None,
                limits=LimitSpec.of(k.limits, k.global_limits),
                expires_at=k.expires_at.timestamp() if k.expires_at else None,
                disabled=k.disabled,
                cancelled=doc.cancel_rule(k.team),
                inference_objective=k.objective(doc.teams.get(k.team))[0],
            )
            keys[key_id] = rec
            by_digest[bytes.fromhex(k.sha256)] = rec
            for old in k.previous:  # the same key, ended by the usual expiry check
                by_digest[bytes.fromhex(old.sha256)] = replace(
                    rec, expires_at=k.old_secret_end(old).timestamp())
        return cls(
            revision=revision,
            doc=doc,
            models={name: LimitSpec.of(m.limits) for name, m in doc.models.items()},
            teams=teams,
            keys_by_digest=by_digest,
            keys=keys,
            passthrough=tuple(PassThrough(p.path, frozenset(p.methods))
                              for p in doc.passthrough),
            prices={name: PriceBook([Rates.of(p) for p in m.prices])
                    for name, m in doc.models.items() if m.prices},
            weights=weights_of(doc),
        )

    def token_weights(self, model: str) -> TokenWeights | None:
        """The model's token weights; None: its tokens count raw (prompt + completion)."""
        return self.weights.get(model) if self.weights else None

    def price(self, model: str, at: float) -> Rates | None:
        """The model's prices in force at `at` (Unix seconds); None: it has none then."""
        book = self.prices.get(model)
        return book.at(at) if book is not None else None

    def models_for(self, key: KeyRecord) -> list[str]:
        """The policy's models this key may use, sorted."""
        return sorted(m for m in self.models if key.may_use(m))

    def tiers_for(self, model: str | None, key: KeyRecord) -> tuple[TierLimit, ...]:
        """The tiers with limits that apply to one request, in the order platform, team, key.

        Memoised per (model, key): the same objects come back for every request, so the
        limiter can cache what it derives from them."""
        memo = self._tiers.get((model, key.key_id))
        if memo is None:
            if len(self._tiers) >= 65536:
                self._tiers.clear()
            memo = self._tiers[model, key.key_id] = tuple(self._tiers_for(model, key))
        return memo

    def _tiers_for(self, model: str | None, key: KeyRecord) -> list[TierLimit]:
        out = []
        model_spec = self.models.get(model) if model else None
        if model_spec is not None and not model_spec.empty:
            out.append(TierLimit("model", model or "", model_spec))
        team_spec = self.teams.get(key.team)
        if team_spec is not None and not team_spec.empty:
            out.append(TierLimit("team", key.team, team_spec))
        if not key.limits.empty:
            out.append(TierLimit("key", key.key_id, key.limits))
        return out


def weights_of(doc: PolicyDoc) -> dict[str, TokenWeights]:
    """The models whose token weights are not all 1 (the rest count raw tokens)."""
    out = {}
    for name, m in doc.models.items():
        if (t := m.token_weights) is not None:
            w = TokenWeights(t.input, t.cached_input, t.cache_creation, t.output)
            if not w.default:
                out[name] = w
    return out
