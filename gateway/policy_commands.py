"""`gateway policy apply|show|status`: the operator's commands on a spoke's policy (its
Redis, or the embedded mode's file), and `policy schema`, the document's JSON Schema; what
`gateway keys ...` shares with them (the store from the settings, an async call run, the
revision read: gateway/key_commands.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from gateway.errors import PolicyError
from gateway.settings import Settings, cli_settings

_settings = cli_settings


def policy_backend(s: Settings) -> Any:
    from gateway.policy.admin import FileBackend, RedisBackend
    if s.redis_url:
        from gateway.policy.store import PolicyStore
        from gateway.redis_clients import policy_client
        return RedisBackend(PolicyStore(policy_client(s.redis_url, s.redis_deadline_ms / 1000)))
    if s.policy_file:
        return FileBackend(s.policy_file)
    # A usage error (argparse's exit 2), not exit 1: that is a Redis that does not answer.
    print("error: no policy store: set GATEWAY_REDIS_URL or --redis-url (a spoke), or "
          "GATEWAY_POLICY_FILE or --policy-file (embedded mode)", file=sys.stderr)
    raise SystemExit(2)


def cmd_policy_apply(args: argparse.Namespace) -> int:
    from gateway.policy import admin
    path = Path(args.file)
    try:
        text = sys.stdin.buffer.read() if args.file == "-" else path.read_bytes()
    except OSError as exc:  # the file named: absent, a directory, unreadable
        print(f"nothing published: cannot read {args.file}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    try:
        done = run_value(admin.apply(policy_backend(_settings(args)), text, str(path),
                                      prune=args.prune, allow_empty=args.allow_empty,
                                      dry_run=args.dry_run))
    except PolicyError as err:
        print("invalid policy, nothing published:", file=sys.stderr)
        for p in err.problems:
            print(f"  {err.source}: {p}", file=sys.stderr)
        return 2
    except (admin.ApplyRefused, OSError) as exc:  # OSError: embedded mode's file unwritable
        print(f"nothing published: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. a revision conflict: say it, exit non-zero
        from redis.exceptions import RedisError
        if isinstance(exc, RedisError):
            raise  # Redis down: `gateway.cli.main` says so, naming GATEWAY_REDIS_URL
        print(f"error: {exc}", file=sys.stderr)
        return 1
    warn(done.warnings)
    print(f"changes against revision {done.base}:")
    print("\n".join(done.diff.lines()))
    if done.revision is not None:
        print(f"applied revision {done.revision}")
        return 0
    print("dry run: nothing published")
    if done.refused:
        print(f"apply would refuse: {done.refused}", file=sys.stderr)
        return 2
    return 0


def read_policy(args: argparse.Namespace) -> tuple[int, Any]:
    """The stored policy, for a command that only reads it. None stored yet is an empty
    policy at revision 0, said on stderr: a mistyped --policy-file or a Redis nothing was
    applied to must not pass for a policy with no keys."""
    from gateway.policy.admin import FileBackend
    backend = policy_backend(_settings(args))
    rev, doc = run_value(backend.read())
    if isinstance(backend, FileBackend):  # a hand-written file may carry no revision
        where = f"{backend.path} does not exist" if not backend.path.exists() else None
    else:
        where = "none stored in Redis" if rev == 0 else None
    if where:
        print(f"note: no policy yet ({where}): `gateway policy apply FILE` makes one",
              file=sys.stderr)
    return rev, doc


def cmd_policy_show(args: argparse.Namespace) -> int:
    from gateway.policy.loader import dump_json, dump_yaml
    rev, doc = read_policy(args)
    if args.output == "json":
        sys.stdout.buffer.write(dump_json(doc, rev) + b"\n")
    else:
        sys.stdout.write(dump_yaml(doc, rev))
    return 0


def cmd_policy_schema(args: argparse.Namespace) -> int:
    """The policy document's JSON Schema, for an editor's modeline or a CI check before
    `policy apply` / `hub publish`; reads no store (docs/policy.schema.json is its output)."""
    from gateway.policy.json_schema import policy_json_schema_text
    sys.stdout.write(policy_json_schema_text())
    return 0


def cmd_policy_check(args: argparse.Namespace) -> int:
    """Validate documents offline, as `policy apply` and `hub publish` do (each field, and
    what spans fields), without a store: for CI and a hub's tooling. Prints one line a
    valid file and its warnings; exit 2 if any file is invalid or unreadable."""
    from gateway.policy.loader import load
    bad = 0
    for name in args.files:
        try:
            text = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
        except OSError as exc:
            print(f"{name}: cannot read: {exc.strerror or exc}", file=sys.stderr)
            bad += 1
            continue
        try:
            policy = load(text, source=name)  # compiled too: what a sidecar would serve
        except PolicyError as err:
            print(f"{name}: invalid:", file=sys.stderr)
            for p in err.problems:  # a YAML syntax error's text spans lines: keep them under it
                print(textwrap.indent(p, "  "), file=sys.stderr)
            bad += 1
            continue
        doc = policy.doc
        empty = () if doc.models else (  # valid, but what apply and publish refuse unasked
            "no models: every request would be refused (404); policy apply and hub publish "
            "refuse it without --allow-empty",)
        warn(tuple(f"{name}: {w}" for w in (*empty, *doc.acl_warnings())))
        counts = ", ".join(f"{n} {what}{'' if n == 1 else 's'}" for n, what in (
            (len(doc.models), "model"), (len(doc.teams), "team"), (len(doc.keys), "key")))
        print(f"{name}: valid ({counts})")
    return 2 if bad else 0


def run_value(coro: Any) -> Any:
    async def wrap() -> Any:
        return await coro
    return asyncio.run(wrap())


def cmd_policy_status(args: argparse.Namespace) -> int:
    s = _settings(args)
    if not s.redis_url:
        rev, _ = run_value(policy_backend(s).read())
        print(f"embedded mode: {s.policy_file} revision {rev} (no per-instance status)")
        return 0
    from gateway.policy.store import PolicyStore
    from gateway.redis_clients import policy_client

    async def fetch() -> tuple[int, dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        store = PolicyStore(policy_client(s.redis_url or "", s.redis_deadline_ms / 1000))
        return (await store.current_revision(), await store.statuses(),
                await store.sync_statuses())

    current, rows, syncers = run_value(fetch())
    print(f"current revision: {current}")
    print(f"{'INSTANCE':32} {'HELD':>5} {'STATE':5} {'LAST SEEN':>10}  ERROR")
    now = time.time()
    for inst, r in sorted(rows.items()):
        age = f"{now - r['seen_at']:.0f}s ago"
        print(f"{inst:32} {r['revision']:>5} {r['state']:5} {age:>10}  {r.get('error') or ''}")
    if syncers:  # `policy sync` followers of the hub's feed
        print(f"\n{'SYNCER':32} {'FEED':5} {'FEED REV':>8} {'HELD':>5} {'STATE':5} "
              f"{'LAST SEEN':>10}  ERROR")
        for name, r in sorted(syncers.items()):
            age = f"{now - r['seen_at']:.0f}s ago"
            err = r.get("error") or ""
            if r["feed"] != "up":
                err = f"feed unreachable, retrying: {r.get('feed_error')}" + (
                    f"; {err}" if err else "")
            print(f"{name:32} {r['feed']:5} {r.get('feed_revision') or '-':>8} "
                  f"{r['revision']:>5} {r['state']:5} {age:>10}  {err}")
            if r.get("allowances"):
                print(f"  {allowances_text(r['allowances'], now)}")
    nack = [*rows.values(), *syncers.values()]
    return 1 if any(r["state"] == "NACK" for r in nack) else 0


def warn(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


def allowances_text(state: dict[str, Any], now: float) -> str:
    """The allowance follower's line under its syncer's row (`FollowerState` as a dict):
    e.g. `allowances: generation 4, 12s ago` or `allowances: none yet; kafka away, retrying`."""
    applied = (f"generation {state['generation']}, {now - state['applied_at']:.0f}s ago"
               if state.get("applied_at") else "none yet")
    error = state.get("error") or ""
    away = [f"{what} away, retrying" + (f": {error.partition(': ')[2]}"
                                        if error.startswith(tag) else "")
            for what, tag, up in (("kafka", "kafka", state.get("kafka_up")),
                                  ("redis", "store", state.get("store_up")))
            if not up]
    return "; ".join([f"allowances: {applied}", *away])
