"""Operator actions on the whole policy (apply: validate, diff, refuse what would take a spoke
down), for Redis or a file, and the stores both read and write (Backend). The edits of one
key (create, update, rotate, revoke, enable, list) are gateway/policy/key_edits.py.

Each edit is read-modify-write of a whole document with a compare-and-set on the revision,
so two operators editing at once cannot silently lose one another's change.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.errors import ApplyRefused, PolicyError
from gateway.policy.loader import dump_yaml, parse_doc
from gateway.policy.schema import PolicyDoc
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


def validated(data: dict[str, Any]) -> PolicyDoc:
    """The same checks as `policy apply`, so an edit cannot publish what apply would refuse."""
    return parse_doc(orjson.dumps(data), "edited policy")


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


