"""`gateway usage report`: what the billing team invoices from, read from the events table.

Requests are split by outcome, so a denial is never counted as a billable request, and
the period the totals cover is stated with them. Tokens are summed over the events that
are not denials (a denial's usage is zero anyway).
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime

import orjson

from gateway.billing.db import UsageDb
from gateway.errors import ReportError

OUTCOMES = ("completed", "client_cancelled", "upstream_error", "denied")
GROUPS = {"team": "team", "key": "key_id", "model": "model"}


@dataclass(frozen=True)
class Row:
    name: str
    completed: int
    client_cancelled: int
    upstream_error: int
    denied: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Report:
    by: str
    since: str  # RFC 3339, inclusive ("" = from the first event)
    until: str  # RFC 3339, exclusive ("" = up to the last event)
    first: str  # the earliest and latest event in the period
    last: str
    rows: list[Row]


def day_bound(text: str | None, flag: str) -> str:
    """A --since/--until value: YYYY-MM-DD (midnight UTC) or an RFC 3339 instant, written
    as events write `ended_at` (milliseconds, Z), so the two compare as text in time order."""
    if not text:
        return ""
    try:
        if len(text) == 10:
            return date.fromisoformat(text).isoformat() + "T00:00:00.000Z"
        ts = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(
            f"{flag} {text!r} is not a date: use YYYY-MM-DD or 2026-11-30T12:00:00Z") from None
    if ts.tzinfo is None:
        raise ReportError(f"{flag} {text!r} has no time zone: add Z or +00:00")
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def report(db: UsageDb, by: str, since: str = "", until: str = "") -> Report:
    if since and until and since >= until:
        raise ReportError(f"--since {since} is not before --until {until}")
    if not db.has_events():
        raise ReportError(f"{db.url} holds no usage events: fill it with `gateway usage "
                          f"consume --db {db.url}` first")
    column = GROUPS[by]
    rows, first, last = db.by_outcome(column, since, until)
    return Report(by, since, until, first, last, [Row(*r) for r in rows])


def render(rep: Report, fmt: str) -> str:
    if fmt == "json":
        return orjson.dumps(asdict(rep), option=orjson.OPT_INDENT_2).decode()
    head = (rep.by, *OUTCOMES, "prompt_tokens", "completion_tokens", "total_tokens")
    cells = [(r.name or "-", *(str(v) for v in list(asdict(r).values())[1:])) for r in rep.rows]
    if fmt == "csv":
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(head)
        w.writerows(cells)
        return out.getvalue().rstrip("\n")
    period = (f"period: {rep.since or 'the beginning'} to {rep.until or 'now'} "
              f"(events from {rep.first or '-'} to {rep.last or '-'}); "
              f"tokens exclude denials")
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(head)]
    lines = [period, "  ".join(h.upper().ljust(w) if i == 0 else h.upper().rjust(w)
                               for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(cell, widths, strict=True)))
              for cell in cells]
    if not cells:
        lines.append("(no events in this period)")
    return "\n".join(lines)
