"""`gateway usage report`: what the billing team invoices from, read from the events table.

Requests are split by outcome, so a denial is never counted as a billable request, and
requests that bill nothing by design (the gateway's own `GET /v1/models`, Anthropic's
`count_tokens`) are counted apart from them. Tokens and cost are summed over the events
that are not denials (a denial's usage and cost are zero anyway); each event's cost was
fixed when it was made, at the price then in force. The period the totals cover is
stated with them.
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from typing import Any

import orjson

from gateway.billing.db import OUTCOMES, UsageDb
from gateway.endpoints import billed
from gateway.errors import ReportError

GROUPS = {"team": "team", "key": "key_id", "model": "model"}
PERIODS = {"day": 10, "month": 7}  # characters of `ended_at` (RFC 3339, UTC) that name one
COST_UNITS = 10**9  # an event's cost is rounded to 1e-9 (gateway/metering/cost.py)
TOKENS = ("prompt_tokens", "cached_tokens", "cache_creation_tokens", "completion_tokens",
          "total_tokens")


@dataclass
class Row:
    group: tuple[str, ...]  # the period (with --per), then one value per --by column
    completed: int = 0
    client_cancelled: int = 0
    upstream_error: int = 0
    denied: int = 0
    not_billed: int = 0  # answered, billing nothing by design: GET /v1/models, count_tokens
    prompt_tokens: int = 0  # every input token; cached and cache_creation are parts of it
    cached_tokens: int = 0
    cache_creation_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cost: float = 0.0

    @property
    def name(self) -> str:
        return "/".join(self.group)


@dataclass(frozen=True)
class Report:
    by: tuple[str, ...]
    per: str  # "" | day | month
    since: str  # RFC 3339, inclusive ("" = from the first event)
    until: str  # RFC 3339, exclusive ("" = up to the last event)
    first: str  # the earliest and latest event in the period
    last: str
    rows: list[Row]

    @property
    def columns(self) -> tuple[str, ...]:
        return ((self.per,) if self.per else ()) + self.by


def parse_by(text: str) -> tuple[str, ...]:
    """`--by team,model`: one or more of team, key, model, each once."""
    names = tuple(n.strip() for n in text.split(","))
    bad = [n for n in names if n not in GROUPS]
    if bad or not names or len(set(names)) != len(names):
        raise ReportError(f"--by {text!r}: give one or more of {', '.join(GROUPS)}, "
                          f"comma-separated, each once")
    return names


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


def report(db: UsageDb, by: str | tuple[str, ...], since: str = "", until: str = "",
           per: str = "") -> Report:
    if since and until and since >= until:
        raise ReportError(f"--since {since} is not before --until {until}")
    if not db.has_events():
        raise ReportError(f"{db.url} holds no usage events: fill it with `gateway usage "
                          f"consume --db {db.url}` first")
    dims = parse_by(by) if isinstance(by, str) else by
    raw, first, last = db.totals([GROUPS[d] for d in dims], PERIODS.get(per, 0), since, until)
    return Report(dims, per, since, until, first, last, fold(raw, len(dims), bool(per)))


def fold(raw: list[tuple[Any, ...]], ndims: int, per: bool) -> list[Row]:
    """The database's (dims..., period, endpoint, outcome, counts...) rows into one Row per
    (period, dims), requests placed by outcome or as not billed."""
    rows: dict[tuple[str, ...], Row] = {}
    nanos: dict[tuple[str, ...], int] = {}  # cost in 1e-9 units: summed exactly
    for r in raw:
        dims, period, endpoint, outcome = r[:ndims], r[ndims], r[ndims + 1], r[ndims + 2]
        n, *tokens, cost = r[ndims + 3:]
        group = ((str(period),) if per else ()) + tuple(str(d) for d in dims)
        row = rows.setdefault(group, Row(group))
        if outcome == "denied":
            row.denied += int(n)
            continue
        if not billed(str(endpoint)):  # /v1/models, count_tokens: not billed requests
            row.not_billed += int(n)
        elif outcome in OUTCOMES:
            setattr(row, outcome, getattr(row, outcome) + int(n))
        for name, value in zip(TOKENS, tokens, strict=True):
            setattr(row, name, getattr(row, name) + int(value or 0))
        nanos[group] = nanos.get(group, 0) + int(cost or 0)
    for group, n in nanos.items():
        rows[group].cost = n / COST_UNITS  # the nearest float to the exact sum
    return [rows[g] for g in sorted(rows)]


def _cells(row: Row) -> list[str]:
    counts = [row.completed, row.client_cancelled, row.upstream_error, row.denied,
              row.not_billed, *(getattr(row, t) for t in TOKENS)]
    return [*(g or "-" for g in row.group), *(str(v) for v in counts), f"{row.cost:.6f}"]


def render(rep: Report, fmt: str) -> str:
    if fmt == "json":
        data = asdict(rep) | {"columns": list(rep.columns)}
        data["rows"] = [{"name": r.name} | dict(zip(rep.columns, r.group, strict=True))
                        | {k: v for k, v in asdict(r).items() if k != "group"}
                        for r in rep.rows]  # name: the group's values joined by "/"
        return orjson.dumps(data, option=orjson.OPT_INDENT_2).decode()
    head = (*rep.columns, *OUTCOMES, "not_billed", *TOKENS, "cost")
    cells = [_cells(r) for r in rep.rows]
    if fmt == "csv":
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(head)
        w.writerows(cells)
        return out.getvalue().rstrip("\n")
    period = (f"period: {rep.since or 'the beginning'} to {rep.until or 'now'} "
              f"(events from {rep.first or '-'} to {rep.last or '-'}); tokens and cost "
              f"exclude denials; not_billed: GET /v1/models, count_tokens")
    nkeys = len(rep.columns)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(head)]

    def line(values: tuple[str, ...] | list[str], upper: bool = False) -> str:
        return "  ".join((v.upper() if upper else v).ljust(w) if i < nkeys else
                         (v.upper() if upper else v).rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths, strict=True)))
    lines = [period, line(head, upper=True), *(line(c) for c in cells)]
    if not cells:
        lines.append("(no events in this period)")
    return "\n".join(lines)
