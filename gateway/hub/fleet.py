"""`gateway hub status`: the fleet as the status topic tells it, beside what the feed holds
for each spoke. Pure: built from the topics' latest values, rendered as JSON or a table."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.hub import feed

FRESH_HEARTBEATS = 3  # an instance silent for longer than this many intervals is stale


# Each field of a report and the JSON types it may have (DESIGN §10; null: not said).
_TYPES: dict[str, tuple[type, ...]] = {
    "revision": (int,), "state": (str,), "error": (str,), "at": (str,),
    "spool_depth": (int,), "spool_oldest_s": (int, float), "limiter_store_up": (bool,)}


def _typed(key: str, s: dict[str, Any]) -> dict[str, Any]:
    """The report's fields, each of its contract type or None. A report with a field of
    another type (a foreign or older reporter) is shown as "unreadable", the fields it does
    have right kept: its raw values would break a tool reading `hub status -o json`, and
    the table (a revision "3" cannot be compared with the feed's)."""
    out: dict[str, Any] = {}
    wrong = []
    for name, types in _TYPES.items():
        value = s.get(name)
        ok = value is None or (isinstance(value, types)
                               and (bool in types or not isinstance(value, bool)))
        out[name] = value if ok else None
        if not ok:
            wrong.append(f"{name}: {orjson.dumps(value).decode()[:40]}")
    if wrong:
        out["state"] = "unreadable"
        out["error"] = f"{key}: not of the contract's type: {', '.join(wrong)}"
    return out


def _age(at: str | None, now: float) -> float | None:
    if at is None:
        return None
    try:
        ts = datetime.fromisoformat(at)
    except ValueError:
        return None
    if ts.tzinfo is None:  # RFC 3339 always has an offset; read none as UTC, not local
        ts = ts.replace(tzinfo=UTC)
    return round(max(0.0, now - ts.timestamp()), 1)


def fleet(statuses: dict[str, bytes], policies: dict[str, bytes], now: float) -> dict[str, Any]:
    """`{"spokes": [{"spoke", "feed_revision", "instances": [...]}]}` (DESIGN §10): every
    spoke that reports or has its own feed entry, sorted; an unreadable report is an
    instance in state "unreadable" rather than left out."""
    spokes: dict[str, list[dict[str, Any]]] = {
        k: [] for k in policies if k != feed.EVERY_SPOKE}
    for key, raw in statuses.items():
        spoke, _, instance = key.partition("/")
        try:
            s = orjson.loads(raw)
            if not isinstance(s, dict):
                raise ValueError("not an object")
            t = _typed(key, s)
        except ValueError as exc:
            t = {"state": "unreadable", "error": f"{key}: {exc}"}
        spokes.setdefault(spoke, []).append({
            "instance": instance,
            "revision": t.get("revision"),
            "state": t.get("state"),
            "error": t.get("error"),
            "age_s": _age(t.get("at"), now),
            "spool_depth": t.get("spool_depth"),
            "spool_oldest_s": t.get("spool_oldest_s"),
            "limiter_store_up": t.get("limiter_store_up"),
        })
    return {"spokes": [
        {"spoke": name, "feed_revision": feed.feed_revision(policies, name),
         "instances": sorted(spokes[name], key=lambda i: i["instance"])}
        for name in sorted(spokes)]}


def highest_reported(statuses: dict[str, bytes]) -> int:
    """The highest revision any instance says it holds (0: none readable). A publish goes
    above it: a spoke that holds a revision the feed never had (the topic lost, or a local
    `policy apply`) would hold the feed's revision of the same number, not apply it."""
    best = 0
    for raw in statuses.values():
        try:
            rev = orjson.loads(raw).get("revision")
        except (ValueError, AttributeError):
            continue
        if isinstance(rev, int) and not isinstance(rev, bool):
            best = max(best, rev)
    return best


def lagging(spoke: dict[str, Any]) -> list[str]:
    """Instances holding less than the feed's revision for their spoke."""
    want = spoke["feed_revision"]
    return [i["instance"] for i in spoke["instances"]
            if want is not None and (i["revision"] or 0) < want]


def ahead(spoke: dict[str, Any]) -> list[str]:
    """Instances holding more than the feed's revision for their spoke: a local `policy
    apply`, or a feed that lost its entry. The feed's document is then not what they serve,
    and they will not take it (revisions never go back) until one above theirs is published."""
    want = spoke["feed_revision"]
    return [i["instance"] for i in spoke["instances"]
            if want is not None and (i["revision"] or 0) > want]


def silent(instance: dict[str, Any], interval: float) -> bool:
    """Silent for more than FRESH_HEARTBEATS heartbeats (an unknown age is not silent)."""
    age = instance["age_s"]
    return age is not None and age > FRESH_HEARTBEATS * interval


def table(view: dict[str, Any], interval: float) -> str:
    """One line per instance; a spoke's header says whether its live instances lag behind
    the feed, hold a revision the feed does not have, or refuse one, and how many are
    silent: those are left out of the rest, since an instance gone for good (a pod a
    rollout replaced) stays listed at the revision it had until `hub forget`."""
    out = []
    width = max([28, *(len(i["instance"]) for sp in view["spokes"] for i in sp["instances"])])
    for sp in view["spokes"]:
        quiet = [i for i in sp["instances"] if silent(i, interval)]
        live = {**sp, "instances": [i for i in sp["instances"] if i not in quiet]}
        behind, above = lagging(live), ahead(live)
        nacks = [i for i in live["instances"] if i["state"] == "nack"]
        marks = ([f"LAGGING ({len(behind)} behind)"] if behind else []) + (
            [f"AHEAD OF THE FEED ({len(above)}: publish again)"] if above else []) + (
            [f"NACK ({len(nacks)})"] if nacks else [])
        if not sp["instances"]:
            marks = ["NO INSTANCE REPORTS"]
        elif live["instances"] and not marks:
            marks = ["in step"]
        if quiet:
            marks.append(f"SILENT ({len(quiet)}: over {FRESH_HEARTBEATS} heartbeats)")
        mark = ", ".join(marks)
        if sp["feed_revision"] is None:
            mark = "no feed entry"
        out.append(f"spoke {sp['spoke']}: feed revision {sp['feed_revision'] or '-'}, {mark}")
        out.append(f"  {'INSTANCE':{width}} {'REV':>5} {'STATE':5} {'AGE':>7} {'SPOOL':>6} "
                   f"{'OLDEST':>7} {'STORE':5}  ERROR")
        for i in sp["instances"]:
            age = i["age_s"]
            age_text = "?" if age is None else f"{age:.0f}s"
            if silent(i, interval):
                age_text += "!"
            store = {True: "up", False: "DOWN"}.get(i["limiter_store_up"], "?")
            oldest = i["spool_oldest_s"]
            out.append(
                f"  {i['instance']:{width}} "
                f"{i['revision'] if i['revision'] is not None else '-':>5} "
                f"{(i['state'] or '?'):5} {age_text:>7} {i['spool_depth'] or 0:>6} "
                f"{(oldest or 0):>6.0f}s {store:5}  {i['error'] or ''}".rstrip())
    if not out:
        return "no spoke has reported on llm.gateway.status.v1 yet\n"
    out.append(f"(AGE! = silent for more than {FRESH_HEARTBEATS} heartbeats of {interval:g}s)")
    return "\n".join(out) + "\n"
