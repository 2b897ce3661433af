"""Pydantic schema of the policy document (DESIGN §2). Unknown keys are errors.

This is the contract with operators and the hub; `model.py` compiles it into the
runtime form the request path reads.
"""

from __future__ import annotations

import fnmatch
import math
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)

from gateway.errors import PathError
from gateway.policy.billing_rules import DEFAULT_CANCEL_RULE, CancelRule
from gateway.policy.fields import (
    Count,
    Flag,
    Glob,
    KeyId,
    Name,
    ObjectiveName,
    PerMillion,
    PositiveCount,
    Rate,
    Sha256Hex,
    Timestamp,
    Weight,
)
from gateway.routes import canonical_path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    """Absent limit = unlimited at this tier. Tokens count prompt + completion, weighted by
    the model's `token_weights` when it has them."""

    rps: Rate | None = None
    burst: PositiveCount | None = None
    concurrency: Count | None = None
    tokens_per_minute: Count | None = None
    tokens_per_day: Count | None = None
    tokens_per_month: Count | None = None

    @model_validator(mode="after")
    def _burst_needs_rps(self) -> Limits:
        if self.burst is not None and self.rps is None:
            raise ValueError("burst is set but rps is not")
        return self

    @property
    def effective_burst(self) -> int | None:
        if self.rps is None:
            return None
        return self.burst if self.burst is not None else max(1, math.ceil(self.rps))


class GlobalLimits(_Strict):
    """One quota for all spokes together (DESIGN §10): the hub's allocator divides it into
    per-spoke allowances; a spoke that holds none enforces the fallback share
    (`gateway.limits.maths.GLOBAL_FALLBACK_SHARE`)."""

    tokens_per_day: Count | None = None
    tokens_per_month: Count | None = None


class Billing(_Strict):
    """How a stream the client cancelled is billed: what the engine `generated`, what was
    `delivered` to the client, or `none`. Absent: the platform's rule (top level), whose
    own default is `generated`."""

    cancelled: CancelRule | None = None


class Price(_Strict):
    """A model's prices per million tokens from `effective` on (until the next entry's), in
    the price table's currency. Cached input and cache creation default to `input`."""

    effective: Timestamp
    input: PerMillion
    cached_input: PerMillion | None = None
    cache_creation: PerMillion | None = None
    output: PerMillion


class TokenWeightsPolicy(_Strict):
    """What one token of each kind counts toward the token limits, every tier's, as written
    (compiled into gateway/token_weights.py TokenWeights by model.weights_of; the same
    kinds as `prices`); each defaults to 1. Absent, or all 1: prompt + completion."""

    input: Weight = 1.0
    cached_input: Weight = 1.0
    cache_creation: Weight = 1.0
    output: Weight = 1.0


class ModelPolicy(_Strict):
    limits: Limits = Limits()
    token_weights: TokenWeightsPolicy | None = None
    # The price history: a revision adds an entry rather than editing one, so what was
    # billed before its date stays billed at the old price.
    prices: list[Price] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_price_per_instant(self) -> ModelPolicy:
        seen = [p.effective for p in self.prices]
        if len(set(seen)) != len(seen):
            raise ValueError("two prices with the same `effective` instant: which one applies?")
        return self


class TeamPolicy(_Strict):
    models: list[Glob] = Field(default_factory=list)
    limits: Limits = Limits()
    global_limits: GlobalLimits = GlobalLimits()
    billing: Billing = Billing()  # overrides the platform's, rule by rule
    inference_objective: ObjectiveName | None = None  # its keys' unless a key names its own


MAX_PREVIOUS = 4  # a rotation prunes the entries already past their `until`


class PreviousSecret(_Strict):
    """A secret the key had before `keys rotate`: still accepted, as the same key (its
    limits, counters and events), until `until` (and never past the key's own expiry)."""

    sha256: Sha256Hex
    until: Timestamp


class KeyPolicy(_Strict):
    team: Name
    sha256: Sha256Hex
    previous: list[PreviousSecret] = Field(default_factory=list, max_length=MAX_PREVIOUS)
    models: list[Glob] | None = None
    limits: Limits = Limits()
    global_limits: GlobalLimits = GlobalLimits()
    expires_at: Timestamp | None = None
    disabled: Flag = False
    inference_objective: ObjectiveName | None = None  # wins over its team's

    def objective(self, team: TeamPolicy | None) -> tuple[str, str]:
        """(the InferenceObjective this key's requests name, where from: "key", "team"),
        ("", "") when neither names one."""
        if self.inference_objective:
            return self.inference_objective, "key"
        if team is not None and team.inference_objective:
            return team.inference_objective, "team"
        return "", ""

    def old_secrets_end(self, now: datetime) -> list[datetime]:
        """When each previous secret still valid at `now` stops being so (its `until`, or
        the key's own expiry if sooner); none while the key is disabled."""
        if self.disabled:
            return []
        return sorted(end for end in map(self.old_secret_end, self.previous) if end > now)

    def old_secret_end(self, old: PreviousSecret) -> datetime:
        """When a previous secret stops being this key: its `until`, or the key's own expiry
        if sooner."""
        return min(old.until, self.expires_at) if self.expires_at else old.until


Method = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


# What `_canonical` refuses that a pattern can see: not absolute, a query or fragment, a
# %-escape, a backslash, '//', a '.' or '..' segment, a control character.
CANONICAL_PATH_PATTERN = (r"^(?!.*//)(?!.*/\.\.?(?:/|$))(?!.*%[0-9A-Fa-f]{2})"
                          r"/[^?#\\\x00-\x1f\x7f]*$")


def _canonical(path: str) -> str:
    try:
        canonical = canonical_path(path)
    except PathError as exc:
        raise ValueError(str(exc)) from None
    if canonical != path or "?" in path or "#" in path:
        raise ValueError(
            f"must be a canonical path (no %-escapes, '//', '.' or '..' segments, query): "
            f"{path!r} (did you mean {canonical!r}?)")
    return path


class PassThroughPolicy(_Strict):
    """A non-inference path the engine serves and keys may reach (e.g. a tokenizer)."""

    path: Annotated[str, StringConstraints(min_length=1, max_length=256),
                    AfterValidator(_canonical), WithJsonSchema(
                        {"type": "string", "minLength": 1, "maxLength": 256,
                         "pattern": CANONICAL_PATH_PATTERN})]
    methods: list[Method] = Field(default_factory=lambda: list[Method](["GET"]), min_length=1)


class PolicyDoc(_Strict):
    revision: PositiveCount | None = None  # Redis's Lua
    models: dict[Name, ModelPolicy] = Field(default_factory=dict)
    teams: dict[Name, TeamPolicy] = Field(default_factory=dict)
    keys: dict[KeyId, KeyPolicy] = Field(default_factory=dict)
    passthrough: list[PassThroughPolicy] = Field(default_factory=list)
    billing: Billing = Billing()  # the platform default; teams may override it

    def cancel_rule(self, team: str) -> CancelRule:
        """The rule for `team`'s client-cancelled streams: its own, else the platform's."""
        t = self.teams.get(team)
        return (t.billing.cancelled if t is not None else None) or self.billing.cancelled \
            or DEFAULT_CANCEL_RULE

    def cross_problems(self) -> list[str]:
        """Checks that span sections: pydantic reports per-field problems, these relate fields."""
        problems = []
        seen: dict[str, str] = {}
        for key_id, key in self.keys.items():
            if key.team not in self.teams:
                problems.append(f"keys.{key_id}.team: unknown team {key.team!r}")
            if key.sha256 in seen:
                problems.append(f"keys.{key_id}.sha256: same digest as keys.{seen[key.sha256]}")
            seen.setdefault(key.sha256, key_id)
        for key_id, key in self.keys.items():  # after every current digest: this names the old
            for i, old in enumerate(key.previous):
                if old.sha256 in seen:
                    problems.append(f"keys.{key_id}.previous.{i}.sha256: same digest as "
                                    f"keys.{seen[old.sha256]}")
                seen.setdefault(old.sha256, f"{key_id}.previous.{i}")
        problems += self.acl_problems()
        return problems

    def acl_problems(self) -> list[str]:
        """An ACL entry naming one model that `models` lacks is a typo or a model since
        removed: the key would get 403 on what it was meant to use. A glob that matches
        none is only a warning (acl_warnings): it may grant a family ahead of its first
        model (DESIGN §2's own `"llama-*"`)."""
        return [f"{path}.{i}: model {pattern!r} matches no model in `models` "
                f"({_some(list(self.models))})"
                for path, i, pattern in self._unmatched_acl() if not _is_glob(pattern)]

    def _unmatched_acl(self) -> list[tuple[str, int, str]]:
        """(path, index, entry) of each ACL entry that matches no model of `models`."""
        models = list(self.models)
        lists = [(f"teams.{name}.models", t.models) for name, t in self.teams.items()]
        lists += [(f"keys.{kid}.models", k.models) for kid, k in self.keys.items()
                  if k.models is not None]
        return [(path, i, pattern) for path, patterns in lists
                for i, pattern in enumerate(patterns)
                if pattern != "*" and not any(fnmatch.fnmatchcase(m, pattern) for m in models)]

    def acl_warnings(self) -> list[str]:
        """What is worth a look but not an error: a glob that matches no model yet (a grant
        ahead of a family's first model, or a typo), and a key whose own ACL shares no model
        of `models` with its team's (the key narrows the team's ACL, both must allow, so
        every request of it that names a model is refused 403; such a key may be pushed on
        purpose). Disabled keys, and a policy with no models (refused unless asked), are
        not named."""
        if not self.models:
            return []
        out = [f"{path}.{i}: glob {pattern!r} matches no model in `models` "
               f"({_some(list(self.models))}) yet"
               for path, i, pattern in self._unmatched_acl() if _is_glob(pattern)]
        for key_id, key in self.keys.items():
            team = self.teams.get(key.team)
            if key.models is None or team is None or key.disabled:
                continue
            if not any(_matches(m, team.models) and _matches(m, key.models)
                       for m in self.models):
                out.append(f"keys.{key_id}.models {key.models} shares no model with team "
                           f"{key.team}'s {team.models}: every request of {key_id} for a "
                           "model will be refused 403")
        return out


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _matches(model: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(model, p) for p in patterns)


def _some(names: list[str], most: int = 8) -> str:
    shown = ", ".join(sorted(names)[:most]) or "none"
    return shown + (f", ... ({len(names)} in all)" if len(names) > most else "")


def utc_text(ts: datetime) -> str:
    return ts.isoformat().replace("+00:00", "Z")
