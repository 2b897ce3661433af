"""Operator actions on the policy (apply, show, keys create/update/rotate/revoke/enable/list), for
Redis or a file.

Each edit is read-modify-write of a whole document with a compare-and-set on the revision,
so two operators editing at once cannot silently lose one another's change.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.errors import ApplyRefused, PolicyError
from gateway.policy import secrets
from gateway.policy.loader import dump_yaml, parse_doc, to_data
from gateway.policy.schema import MAX_PREVIOUS, PolicyDoc, utc_text
from gateway.policy.store import RevisionConflict


class Backend(Protocol):
    async def read(self) -> tuple[int, PolicyDoc]: ...

    async def write(self, doc: PolicyDoc, expect: int | None) -> int: ...


class FileBackend:
    """Embedded mode: the file is the policy; the running sidecar reloads it on change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def read(self) -> tuple[int, PolicyDoc]:
        if not self.path.exists():
            return 0, PolicyDoc()
        try:
            text = self.path.read_bytes()
        except OSError as exc:  # a directory, unreadable: the path and why, not a traceback
            raise PolicyError([f"cannot read: {exc.strerror}"], str(self.path)) from None
        doc = parse_doc(text, str(self.path))
        return doc.revision or 0, doc

    async def write(self, doc: PolicyDoc, expect: int | None) -> int:
        cur, _ = await self.read()
        if expect is not None and cur != expect:
            raise RevisionConflict(f"revision moved to {cur} while editing; try again")
        new = doc.revision if doc.revision and doc.revision > cur else cur + 1
        text = dump_yaml(doc, new)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".policy-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)  # atomic: the sidecar never reads half a file
        return new


class RedisBackend:
    def __init__(self, store: Any) -> None:
        self.store = store

    async def read(self) -> tuple[int, PolicyDoc]:
        loaded = await self.store.load_doc()
        return loaded if loaded is not None else (0, PolicyDoc())

    async def write(self, doc: PolicyDoc, expect: int | None) -> int:
        return int(await self.store.publish(doc, expect))


def parse_duration(text: str) -> timedelta:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        seconds = float(text[:-1]) * units[text[-1]]
        if not 0 < seconds < 100 * 365 * 86400:
            raise ValueError
        return timedelta(seconds=seconds)
    except (KeyError, ValueError, IndexError, OverflowError):
        raise ValueError(f"bad duration {text!r}: use e.g. 30d, 12h, 90m") from None


def _validated(data: dict[str, Any]) -> PolicyDoc:
    """The same checks as `policy apply`, so an edit cannot publish what apply would refuse."""
    return parse_doc(orjson.dumps(data), "edited policy")


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


@dataclass(frozen=True)
class Diff:
    """What a new document changes, section by section: names added, removed, changed."""

    added: dict[str, list[str]]
    removed: dict[str, list[str]]
    changed: dict[str, list[str]]

    @property
    def empty(self) -> bool:
        return not any((*self.added.values(), *self.removed.values(), *self.changed.values()))

    def lines(self) -> list[str]:
        out = []
        for section in SECTIONS:
            out += [f"  + {section}.{n}" for n in self.added[section]]
            out += [f"  - {section}.{n}" for n in self.removed[section]]
            out += [f"  ~ {section}.{n}" for n in self.changed[section]]
        return out or ["  (no change)"]


SECTIONS = ("models", "teams", "keys", "passthrough", "billing")


def diff(old: PolicyDoc, new: PolicyDoc) -> Diff:
    def named(doc: PolicyDoc, section: str) -> dict[str, Any]:
        if section == "passthrough":  # a path listed twice allows either entry's methods
            methods: dict[str, set[str]] = {}
            for p in doc.passthrough:
                methods.setdefault(p.path, set()).update(p.methods)
            return {path: sorted(m) for path, m in methods.items()}
        if section == "billing":  # the platform's rules, one line each: ~ billing.cancelled
            return {k: v for k, v in doc.billing.model_dump().items() if v is not None}
        return {k: v.model_dump() for k, v in getattr(doc, section).items()}

    added, removed, changed = {}, {}, {}
    for section in SECTIONS:
        a, b = named(old, section), named(new, section)
        added[section] = sorted(b.keys() - a.keys())
        removed[section] = sorted(a.keys() - b.keys())
        changed[section] = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    return Diff(added, removed, changed)


@dataclass(frozen=True)
class Applied:
    revision: int | None  # None: a dry run
    diff: Diff
    base: int  # the revision it replaced
    refused: str = ""  # a dry run: why a real apply would be refused
    warnings: tuple[str, ...] = ()  # accepted, but likely not what was meant


async def apply(backend: Backend, text: bytes, source: str, *, prune: bool = False,
                allow_empty: bool = False, dry_run: bool = False) -> Applied:
    """Validate and publish a whole document, kubectl-apply style.

    A `revision:` equal to the current one is an exported document, edited: it becomes the
    next revision. An older one was exported before someone else published: refused, as
    publishing it would undo their change. A document that removes every model or key, or
    removes keys at all, is refused unless asked for (`allow_empty`, `prune`): `keys
    create` adds keys to the stored document that a hand-kept file does not have.
    """
    doc = parse_doc(text, source)  # raises PolicyError naming the path; nothing published
    base, old, unreadable = await _current(backend)
    if doc.revision is not None and doc.revision < base:
        raise ApplyRefused(
            f"{source} is based on revision {doc.revision}, but revision {base} was published "
            f"since: export it again (gateway policy show), or drop its `revision:` line to "
            f"overwrite")
    if doc.revision == base:
        doc = doc.model_copy(update={"revision": None})
    change = diff(old, doc)
    refused = _refusal(source, old, doc, change, prune=prune, allow_empty=allow_empty)
    warnings = (*unreadable, *doc.acl_warnings())
    if dry_run:
        return Applied(None, change, base, refused, warnings)
    if refused:
        raise ApplyRefused(refused)
    return Applied(await backend.write(doc, base), change, base, warnings=warnings)


async def _current(backend: Backend) -> tuple[int, PolicyDoc, tuple[str, ...]]:
    """The revision an apply replaces. One in Redis that does not validate (a buggy hub, a
    hand edit: every instance NACKed it and serves an older one) is replaced as if empty,
    with a warning: a new revision is the way out of a NACK, so it must not stop one."""
    try:
        base, old = await backend.read()
        return base, old, ()
    except PolicyError as err:
        if not isinstance(backend, RedisBackend):
            raise
        base = await backend.store.current_revision()
        return base, PolicyDoc(), (
            f"revision {base} in Redis is invalid ({'; '.join(err.problems)}): instances "
            f"NACKed it and serve an older one; this document replaces it (its changes are "
            f"listed against an empty policy)",)


def empty_refusal(source: str, new: PolicyDoc, old: PolicyDoc | None, *,
                  allow_empty: bool) -> str:
    """Why `new` is refused without `--allow-empty` ("": it is not): it has no models or no
    keys where `old` has some, so every request would be refused. `old` None: what it
    replaces cannot be seen (`hub publish`: each spoke holds what it holds), any empty
    section is refused. Shared by `policy apply` and `hub publish`."""
    if allow_empty:
        return ""
    empty = [s for s in ("models", "keys")
             if not getattr(new, s) and (old is None or getattr(old, s))]
    if not empty:
        return ""
    return (f"{source} has no {' and no '.join(empty)}: every request would be refused "
            f"(401/404). Pass --allow-empty if that is what you want")


def _refusal(source: str, old: PolicyDoc, new: PolicyDoc, change: Diff, *, prune: bool,
             allow_empty: bool) -> str:
    if refused := empty_refusal(source, new, old, allow_empty=allow_empty):
        return refused
    if change.removed["keys"] and not prune:
        return (f"{source} would remove keys {', '.join(change.removed['keys'])} (made with "
                f"`keys create`, or dropped from the file?): pass --prune to remove them, or "
                f"revoke them with `gateway keys revoke`")
    return ""


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
    valid = _validated(data)
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
    valid = _validated(data)
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
        rows.append({
            "key_id": key_id, "team": k.team, "state": state,
            "models": ",".join(k.models) if k.models is not None else "(team)",
            "expires_at": utc_text(k.expires_at) if k.expires_at else "",
            # an old secret (`keys rotate`) still valid until then; never the secret
            "old_secret_until": utc_text(ends[-1]) if (ends := k.old_secrets_end(now)) else "",
        })
    return rows
