"""`gateway usage ...`: the billing team's commands (tail, consume, report, reconcile)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from gateway.settings import Settings


def _bootstrap(args: argparse.Namespace) -> tuple[str, str]:
    s = Settings.from_args(args)
    if not s.kafka_bootstrap:
        raise SystemExit("set GATEWAY_KAFKA_BOOTSTRAP or --kafka")
    return s.kafka_bootstrap, s.usage_topic


def cmd_usage_tail(args: argparse.Namespace) -> int:
    from gateway.billing.consumer import tail
    bootstrap, topic = _bootstrap(args)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(tail(bootstrap, topic, args.limit, args.follow, args.pretty))
    return 0


def cmd_usage_consume(args: argparse.Namespace) -> int:
    from gateway.billing.consumer import consume
    from gateway.log import configure
    configure("info")
    bootstrap, topic = _bootstrap(args)
    stop = (lambda n: n >= args.count) if args.count else None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(consume(bootstrap, topic, args.db, args.group, stop, args.until_caught_up))
    return 0


def cmd_usage_report(args: argparse.Namespace) -> int:
    from gateway.billing import report
    from gateway.billing.db import UsageDb
    try:
        since = report.day_bound(args.since, "--since")
        until = report.day_bound(args.until, "--until")
        rep = report.report(UsageDb(args.db), args.by, since, until)
    except report.ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.render(rep, args.output))
    return 0


def cmd_usage_reconcile(args: argparse.Namespace) -> int:
    from gateway.billing.db import UsageDb, gaps
    from gateway.sinks.spool import spooled
    db = UsageDb(args.db)
    if not db.has_events():
        print(f"error: {args.db} holds no usage events: fill it with `gateway usage consume "
              f"--db {args.db}` first", file=sys.stderr)
        return 2
    seqs, dups = db.seqs(), db.duplicates()
    pending = spooled(Settings.from_args(args).spool_dir)
    bad = 0
    print(f"{'INSTANCE':32} {'EVENTS':>7} {'MAX SEQ':>8} {'DUPLICATES':>10} {'SPOOLED':>8}  GAPS")
    for inst in sorted(set(seqs) | set(dups) | set(pending)):
        got = seqs.get(inst, [])
        spooled_from = pending.get(inst, (0, 0))
        # A gap at the tail that the instance still holds in its spool is not missing.
        holes = [(a, b) for a, b in gaps(got) if not (spooled_from[1] and a >= spooled_from[0])]
        bad += len(holes)
        text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in holes) or "none"
        print(f"{inst:32} {len(got):>7} {max(got, default=0):>8} {dups.get(inst, 0):>10} "
              f"{spooled_from[1]:>8}  {text}")
    return 1 if bad else 0
