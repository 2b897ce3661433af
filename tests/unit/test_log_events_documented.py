"""docs/log-events.md and the code name the same warning-and-above log events, both ways:
every event gateway/ logs at warning, error, critical or exception level has its row on the
page, and every row names an event gateway/ logs, so an alert built from the page fires."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "log-events.md"
# log.warning("event", ...), the name on the call's line or the next
CALL = re.compile(r"\blog\.(error|warning|critical|exception)\(\s*\"([a-z0-9_]+)\"")
# app.py's _alert(loud, what, bad, now, "error_event", "cleared_event", ...): error level
ALERT = re.compile(r"\b_alert\(\s*loud,\s*\"[a-z_]+\",[^()]*?,\s*now,\s*\"([a-z0-9_]+)\"")
ROW = re.compile(r"^\| `([a-z0-9_]+)` \| (warning|error|critical|exception) \|", re.M)


def calls() -> list[tuple[str, str, str]]:
    """(event, level, where) of each warning-and-above call in gateway/."""
    out = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for m in CALL.finditer(text):
            out.append((m.group(2), m.group(1), f"{where}:{text.count(chr(10), 0, m.start()) + 1}"))
        for m in ALERT.finditer(text):
            out.append((m.group(1), "error", f"{where}:{text.count(chr(10), 0, m.start()) + 1}"))
    return out


def logged() -> dict[str, list[str]]:
    """Each warning-and-above event of gateway/, with where it is logged."""
    found: dict[str, list[str]] = {}
    for event, _, where in calls():
        found.setdefault(event, []).append(where)
    return found


def documented() -> list[str]:
    return [m.group(1) for m in ROW.finditer(PAGE.read_text())]


def test_the_scan_finds_the_events() -> None:
    events = logged()
    assert len(events) >= 60, sorted(events)  # a broken regex must not pass vacuously
    assert {"usage_delivery_failed", "usage_delivery_stalled",
            "limiter_store_unreachable"} <= set(events)


def test_every_logged_event_is_on_the_page() -> None:
    missing = {e: where for e, where in logged().items() if e not in set(documented())}
    assert not missing, f"logged at warning level or above, not in docs/log-events.md: {missing}"


def test_every_event_on_the_page_is_logged() -> None:
    events = logged()
    stale = [e for e in documented() if e not in events]
    assert not stale, f"in docs/log-events.md, logged nowhere in gateway/: {stale}"


def test_each_row_gives_the_level_the_code_logs_at() -> None:
    page = {m.group(1): m.group(2) for m in ROW.finditer(PAGE.read_text())}
    wrong = [(event, level, page[event], where) for event, level, where in calls()
             if event in page and page[event] != level]
    assert not wrong, f"(event, logged at, the page says, where): {wrong}"


def test_each_event_has_one_row() -> None:
    rows = documented()
    assert len(rows) == len(set(rows)), sorted(e for e in set(rows) if rows.count(e) > 1)
