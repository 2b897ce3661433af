"""Operator edits of one key in the policy (keys create/update/rotate/revoke/enable, and the
rows of keys list), for Redis or a file (gateway/policy/admin.py Backend).

Each edit is read-modify-write of the whole document with a compare-and-set on the
revision, validated as `policy apply` validates, so two operators editing at once cannot
silently lose one another's change, and an edit cannot publish what apply would refuse.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway.policy import secrets
from gateway.policy.admin import Backend, validated
from gateway.policy.loader import to_data
from gateway.policy.schema import MAX_PREVIOUS, PolicyDoc, utc_text


def parse_duration(text: str) -> timedelta:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        seconds = float(text[:-1]) * units[text[-1]]
        if not 0 < seconds < 100 * 365 * 86400:
            raise ValueError
        return timedelta(seconds=seconds)
    except (KeyError, ValueError, IndexError, OverflowError):
        raise ValueError(f"bad duration {text!r}: use e.g. 30d, 12h, 90m") from None


def key_warnings(doc: PolicyDoc, key_id: str) -> tuple[str, ...]:
    """The document's ACL warnings about one key (`policy apply` prints them all): what a
    key edit prints, not its neighbours' (a team's glob ahead of its models)."""
    mine = f"keys.{key_id}."
    return tuple(w for w in doc.acl_warnings() if w.startswith(mine))


@dataclass
class NewKey:
    key_id: str
    secret: str
    revision: int
    warnings: tuple[str, ...] = ()  # key_warnings


async def create_key(
    backend: Backend,
    team: str,
    *,
    key_id: str | None = None,
    models: list[str] | None = None,
    expires_in: str | None = None,
    limits: dict[str, Any] | None = None,
    inference_objective: str | None = None,
) -> NewKey:
    rev, doc = await backend.read()
    if team not in doc.teams:  # said here: validation would name the drawn key id's path
        if not (rev or doc.models or doc.teams or doc.keys):
            raise ValueError(f"no team {team!r}: no policy yet (revision 0): `gateway policy "
                             f"apply FILE` makes one, with its teams")
        have = ", ".join(sorted(doc.teams)) or "none"
        raise ValueError(f"no team {team!r} in {f'revision {rev}' if rev else 'the policy'} "
                         f"(its teams: {have}): add it with `gateway policy apply`, or pick "
                         f"one of those")
    key_id = key_id or secrets.new_key_id()
    secret = secrets.new_secret(key_id)
    data = to_data(doc)
    keys = data.setdefault("keys", {})
    if key_id in keys:
        raise ValueError(f"key {key_id} already exists")
    entry: dict[str, Any] = {"team": team, "sha256": secrets.digest(secret).hex()}
    if models:
        entry["models"] = models
    if limits:
        entry["limits"] = {k: v for k, v in limits.items() if v is not None}
    if expires_in:
        entry["expires_at"] = expiry(expires_in).isoformat()
    if inference_objective:
        entry["inference_objective"] = inference_objective
    keys[key_id] = entry
    valid = validated(data)
    return NewKey(key_id, secret, await backend.write(valid, rev), key_warnings(valid, key_id))


@dataclass(frozen=True)
class KeyEdit:
    """An edit of one key: the revision that holds it, and whether this edit made one (an
    edit that changes nothing publishes nothing: revoking a revoked key is not a change)."""

    key_id: str
    revision: int
    changed: bool
    warnings: tuple[str, ...] = ()  # key_warnings, of the revision it made


LIMIT_FIELDS = ("rps", "burst", "concurrency", "tokens_per_minute", "tokens_per_day",
                "tokens_per_month")
UNSET: Any = object()  # an update flag not given: keep what the key has


async def edit_key(backend: Backend, key_id: str,
                   change: Callable[[dict[str, Any]], None]) -> KeyEdit:
    """Read-modify-write one key's entry (compare-and-set on the revision, validated as
    `policy apply` validates); nothing is written when `change` leaves the entry as it was."""
    rev, doc = await backend.read()
    data = to_data(doc)
    if key_id not in data.get("keys", {}):
        raise KeyError(key_id)
    before = copy.deepcopy(data["keys"][key_id])
    change(data["keys"][key_id])
    if data["keys"][key_id] == before:
        return KeyEdit(key_id, rev, False)
    valid = validated(data)
    return KeyEdit(key_id, await backend.write(valid, rev), True, key_warnings(valid, key_id))


async def revoke_key(backend: Backend, key_id: str) -> KeyEdit:
    def revoke(entry: dict[str, Any]) -> None:
        entry["disabled"] = True
    return await edit_key(backend, key_id, revoke)


async def enable_key(backend: Backend, key_id: str) -> KeyEdit:
    """Re-enable a revoked key (its secret is unchanged: whoever held it may use it again)."""
    def enable(entry: dict[str, Any]) -> None:
        entry.pop("disabled", None)
    return await edit_key(backend, key_id, enable)


async def update_key(backend: Backend, key_id: str, *, limits: dict[str, Any] | None = None,
                     models: Any = UNSET, expires_at: Any = UNSET,
                     inference_objective: Any = UNSET) -> KeyEdit:
    """Change a key's limits (a value of None removes that limit), its models (None: the
    team's, no narrowing), its expiry (None: never) or its InferenceObjective (None: its
    team's, if any). What is not given is kept."""
    def update(entry: dict[str, Any]) -> None:
        lim = dict(entry.get("limits", {}))
        for name, value in (limits or {}).items():
            if name not in LIMIT_FIELDS:
                raise ValueError(f"unknown limit {name!r} (one of {', '.join(LIMIT_FIELDS)})")
            if value is None:
                lim.pop(name, None)
            else:
                lim[name] = value
        if "burst" in lim and "rps" not in lim:
            if (limits or {}).get("burst") is not None:  # asked for: say why it cannot be
                raise ValueError("a burst needs an rps limit on the key: give --rps too")
            lim.pop("burst")  # its rate removed: a burst alone means nothing (nor validates)
        if lim:
            entry["limits"] = lim
        else:
            entry.pop("limits", None)
        if models is not UNSET:
            if models is None:
                entry.pop("models", None)
            else:
                entry["models"] = list(models)
        if expires_at is not UNSET:
            if expires_at is None:
                entry.pop("expires_at", None)
            else:
                entry["expires_at"] = utc_text(expires_at)
        if inference_objective is not UNSET:
            if inference_objective is None:
                entry.pop("inference_objective", None)
            else:
                entry["inference_objective"] = inference_objective
    return await edit_key(backend, key_id, update)


@dataclass(frozen=True)
class Rotated:
    """A rotated key: its new secret (shown once), the revision, and until when the secret
    it replaced stays valid (None: it ended at once)."""

    key_id: str
    secret: str
    revision: int
    old_until: datetime | None


def grace_end(grace: str, now: datetime) -> datetime | None:
    """`--grace 24h` as the instant the replaced secret ends (read as `--expires-in` is);
    None for a grace of zero (`0`, `0s`, `0h`...): it ends at once."""
    if re.fullmatch(r"0+(?:\.0*)?[smhdw]?", grace.strip()):
        return None
    return expiry(grace, now)


async def rotate_key(backend: Backend, key_id: str, grace: str = "24h",
                     now: datetime | None = None) -> Rotated:
    """A new secret for the same key id, so its limits, counters, events and billing carry
    on unbroken. The replaced secret stays valid until the grace ends (`previous`); entries
    already past their `until` are pruned, and none outlives this grace (a rotation with a
    shorter grace than the last one's is a hurry: the older secrets end by then too). A
    grace of zero keeps no old secret at all: only the new one is valid from this revision
    on (a leaked secret, however many rotations ago)."""
    now = now or datetime.now(UTC)
    until = grace_end(grace, now)
    secret = secrets.new_secret(key_id)

    def rotate(entry: dict[str, Any]) -> None:
        kept = [{**p, "until": utc_text(min(datetime.fromisoformat(p["until"]), until))}
                for p in entry.get("previous", [])
                if until is not None and datetime.fromisoformat(p["until"]) > now]
        if until is not None:
            kept.append({"sha256": entry["sha256"], "until": utc_text(until)})
        if len(kept) > MAX_PREVIOUS:
            first = min(datetime.fromisoformat(p["until"]) for p in kept)
            raise ValueError(
                f"{key_id} already has {MAX_PREVIOUS} old secrets in their grace (the first "
                f"ends {utc_text(first)}): wait for it, or rotate with --grace 0")
        entry["sha256"] = secrets.digest(secret).hex()
        if kept:
            entry["previous"] = kept
        else:
            entry.pop("previous", None)
    done = await edit_key(backend, key_id, rotate)
    return Rotated(key_id, secret, done.revision, until)


def expiry(expires_in: str | None, now: datetime | None = None) -> datetime:
    """`--expires-in 30d` as the instant it names, rounded up to a whole second: never
    sooner than asked, and printed without microseconds (`keys list`, the policy)."""
    at = (now or datetime.now(UTC)) + parse_duration(expires_in or "")
    return at.replace(microsecond=0) + timedelta(seconds=1) if at.microsecond else at


def key_rows(doc: PolicyDoc, now: datetime | None = None) -> list[dict[str, Any]]:
    now = now or datetime.now(UTC)
    rows = []
    for key_id, k in doc.keys.items():
        state = "disabled" if k.disabled else (
            "expired" if k.expires_at and k.expires_at <= now else "active")
        objective, source = k.objective(doc.teams.get(k.team))
        rows.append({
            "key_id": key_id, "team": k.team, "state": state,
            "models": ",".join(k.models) if k.models is not None else "(team)",
            "expires_at": utc_text(k.expires_at) if k.expires_at else "",
            # an old secret (`keys rotate`) still valid until then; never the secret
            "old_secret_until": utc_text(ends[-1]) if (ends := k.old_secrets_end(now)) else "",
            # the InferenceObjective that applies and whose it is ("key", "team"); null if
            # none, as `keys show` says it (the same fields, one spelling of "none")
            "inference_objective": objective or None, "inference_objective_from": source or None,
        })
    return rows
