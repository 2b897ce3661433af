"""`gateway usage ...`: the billing team's commands (tail, consume, report, reconcile)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.settings import Settings

if TYPE_CHECKING:
    from gateway.billing.db import UsageDb


def open_db(url: str, *, create: bool) -> UsageDb:
    """The billing database of --db, or ValueError naming the flag and what is wrong: a URL
    that is neither sqlite:///FILE nor postgresql:// (it was taken as a file name), a
    database that cannot be opened, or (`create` False: report, reconcile) a SQLite file
    that does not exist (it was created empty)."""
    if not url.startswith(("sqlite://", "postgresql://", "postgres://")):
        raise ValueError(f"--db {url}: not sqlite:///FILE or postgresql://...")
    path = url.removeprefix("sqlite:///").removeprefix("sqlite://") or "usage.db"
    if not create and url.startswith("sqlite") and not Path(path).is_file():
        raise ValueError(f"--db {url}: no such database file: fill it with `gateway usage "
                         f"consume --db {url}` first")
    from gateway.billing.db import UsageDb
    try:
        return UsageDb(url)
    except Exception as exc:  # sqlite3.Error, psycopg.Error: the server or file, named
        shown = re.sub(r"//[^@/]*@", "//", url)  # no user or password
        raise ValueError(f"--db {shown}: cannot open: {str(exc).splitlines()[0]}") from None


def _kafka_error(bootstrap: str, exc: Exception) -> int:
    print(f"error: kafka {bootstrap}: {exc} (is GATEWAY_KAFKA_BOOTSTRAP / --kafka right, and "
          "Kafka up?)", file=sys.stderr)
    return 1


def _bootstrap(args: argparse.Namespace) -> tuple[str, str]:
    s = Settings.from_args(args)
    if not s.kafka_bootstrap:
        raise SystemExit("set GATEWAY_KAFKA_BOOTSTRAP or --kafka")
    return s.kafka_bootstrap, s.usage_topic


def cmd_usage_tail(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError

    from gateway.billing.tail import tail
    bootstrap, topic = _bootstrap(args)
    if args.limit is not None and args.limit < 0:
        print(f"error: -n {args.limit}: give a count of 0 or more", file=sys.stderr)
        return 2

    def write(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(tail(bootstrap, topic, write, args.limit, args.follow, args.pretty))
    except KafkaError as exc:
        return _kafka_error(bootstrap, exc)
    except BrokenPipeError:  # `| head` has what it wanted: stop quietly, as tail(1) does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
    return 0


def cmd_usage_consume(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError

    from gateway.billing.consumer import consume
    from gateway.log import configure
    configure("info", cache=False)  # low volume; run in-process by the tests too
    bootstrap, topic = _bootstrap(args)
    if args.count < 0:
        print(f"error: --count {args.count}: give a count of 0 (no limit) or more",
              file=sys.stderr)
        return 2
    try:
        open_db(args.db, create=True).close()  # a bad --db: said before Kafka is asked
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = (lambda n: n >= args.count) if args.count else None
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(consume(bootstrap, topic, args.db, args.group, stop,
                                args.until_caught_up, args.session_timeout_s))
    except KafkaError as exc:
        return _kafka_error(bootstrap, exc)
    return 0


def cmd_usage_report(args: argparse.Namespace) -> int:
    from gateway.billing import report
    try:
        since = report.day_bound(args.since, "--since")
        until = report.day_bound(args.until, "--until")
        db = open_db(args.db, create=False)
        rep = report.report(db, args.by, since, until, args.per or "")
    except ValueError as exc:  # ReportError included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.render(rep, args.output))
    if unreadable := db.rejected(limit=0)[0]:
        print(f"warning: {unreadable} unreadable record(s) not billed: see `gateway usage "
              f"reconcile`", file=sys.stderr)
    return 0


DEV_SPOOL = Path(".gateway-dev") / "spool"  # where `gateway dev` (default --workdir) spools


def spool_dir(flag: str | None, env: str | None, default: Path) -> Path:
    """The spools to read: the flag, else $GATEWAY_SPOOL_DIR, else the serve default if it
    exists, else `gateway dev`'s. A directory that does not exist is an error (a typo would
    otherwise report nothing spooled), raised as ValueError."""
    chosen = flag or env
    if chosen:
        path = Path(chosen)
        if not path.is_dir():
            how = "--spool-dir" if flag else "$GATEWAY_SPOOL_DIR"
            raise ValueError(f"{how} {chosen}: no such directory")
        return path
    for path in (default, DEV_SPOOL):
        if path.is_dir():
            return path
    raise ValueError(f"no spool directory here ({default} of `gateway serve`, {DEV_SPOOL} of "
                     f"`gateway dev`): pass --spool-dir or set GATEWAY_SPOOL_DIR")


def cmd_usage_reconcile(args: argparse.Namespace) -> int:
    from gateway.billing.db import gaps
    from gateway.sinks.spools import spooled
    try:
        root = spool_dir(args.spool_dir, os.environ.get("GATEWAY_SPOOL_DIR"),
                         Settings.model_fields["spool_dir"].default)
        db = open_db(args.db, create=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    unreadable, first = db.rejected(limit=SHOW_REJECTED)
    if not db.has_events() and not unreadable:
        print(f"error: {args.db} holds no usage events: fill it with `gateway usage consume "
              f"--db {args.db}` first", file=sys.stderr)
        return 2
    seqs, dups = db.seqs(), db.duplicates()
    pending = spooled(root)
    bad = 0
    print(f"spools: {root}", file=sys.stderr)  # which ones, beside the table
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
    if unreadable:  # on the topic, never billed: someone must look at each
        print(f"\nUNREADABLE: {unreadable} record(s) quarantined in rejected_records, not "
              f"billed (first {len(first)}):")
        for r in first:
            print(f"  {r.topic} partition {r.partition} offset {r.offset}: {r.error}")
    return 1 if bad or unreadable else 0


SHOW_REJECTED = 5  # reconcile lists the first few; the table holds them all, values too
