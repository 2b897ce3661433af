"""`gateway policy apply|show|status` and `gateway keys ...`: the operator's commands on a
spoke's policy (its Redis, or the embedded mode's file)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import PolicyError
from gateway.settings import Settings, cli_settings

_settings = cli_settings


def _backend(s: Settings) -> Any:
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
        done = run_value(admin.apply(_backend(_settings(args)), text, str(path),
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
    _warn(done.warnings)
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


def _read(args: argparse.Namespace) -> tuple[int, Any]:
    """The stored policy, for a command that only reads it. None stored yet is an empty
    policy at revision 0, said on stderr: a mistyped --policy-file or a Redis nothing was
    applied to must not pass for a policy with no keys."""
    from gateway.policy.admin import FileBackend
    backend = _backend(_settings(args))
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
    rev, doc = _read(args)
    if args.output == "json":
        sys.stdout.buffer.write(dump_json(doc, rev) + b"\n")
    else:
        sys.stdout.write(dump_yaml(doc, rev))
    return 0


def run_value(coro: Any) -> Any:
    async def wrap() -> Any:
        return await coro
    return asyncio.run(wrap())


def cmd_policy_status(args: argparse.Namespace) -> int:
    s = _settings(args)
    if not s.redis_url:
        rev, _ = run_value(_backend(s).read())
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


def cmd_keys_create(args: argparse.Namespace) -> int:
    from gateway.policy import admin
    limits = {"rps": args.rps, "concurrency": args.concurrency,
              "tokens_per_day": args.tokens_per_day, "tokens_per_minute": args.tokens_per_minute}
    models = [m for m in (args.models or "").split(",") if m] or None
    try:
        new = run_value(admin.create_key(
            _backend(_settings(args)), args.team, key_id=args.key_id, models=models,
            expires_in=args.expires_in, limits=limits,
            inference_objective=args.inference_objective))
    except (PolicyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"key_id:   {new.key_id}\nrevision: {new.revision}\nsecret:   {new.secret}")
    print("The secret is shown once; only its SHA-256 is stored.", file=sys.stderr)
    _warn(new.warnings)
    return 0


def _warn(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    """A new secret for the key (printed once, as `keys create` prints one); the one it
    replaces stays valid for `--grace`."""
    from gateway.policy import admin
    from gateway.policy.schema import utc_text
    done, code = _edited(args, lambda backend, key_id: admin.rotate_key(backend, key_id,
                                                                         args.grace))
    if done is None:
        return code
    old = f"valid until {utc_text(done.old_until)}" if done.old_until else "ended now"
    print(f"key_id:   {done.key_id}\nrevision: {done.revision}\nsecret:   {done.secret}\n"
          f"previous: {old}")
    print("The secret is shown once; only its SHA-256 is stored.", file=sys.stderr)
    return 0


def cmd_keys_mint(args: argparse.Namespace) -> int:
    """A key for a hand-written policy: the secret (shown once) and the entry to paste."""
    import re

    from gateway.policy import secrets
    if not re.fullmatch(secrets.KEY_ID_PATTERN, args.key_id):
        print(f"error: key id {args.key_id!r} is not {secrets.KEY_ID_RULE}", file=sys.stderr)
        return 2
    secret = secrets.new_secret(args.key_id)
    sha = secrets.digest(secret).hex()
    print(f"secret:   {secret}\nsha256:   {sha}")
    print(f"\npolicy entry (under keys:):\n  {args.key_id}:\n    team: {args.team}\n"
          f"    sha256: \"{sha}\"")
    print("The secret is shown once; only its SHA-256 belongs in the policy.", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from gateway.policy import admin
    _, doc = _read(args)
    rows = admin.key_rows(doc)
    if args.output == "json":
        print(orjson.dumps(rows).decode())
        return 0
    print(f"{'KEY_ID':20} {'TEAM':16} {'STATE':9} {'EXPIRES':26} {'OLD SECRET UNTIL':22} MODELS")
    for r in rows:
        print(f"{r['key_id']:20} {r['team']:16} {r['state']:9} {r['expires_at']:26} "
              f"{r['old_secret_until']:22} {r['models']}")
    return 0


def _a_secret(key_id: str) -> bool:
    """A secret given where a key id goes: said without echoing it (a terminal's scrollback,
    a CI log), with the key id it carries."""
    from gateway.policy import secrets
    if not key_id.startswith(secrets.PREFIX):
        return False
    carried = key_id.removeprefix(secrets.PREFIX).split("-", 1)[0]
    print(f"error: that is a key's secret, not its key id: give the key id ({carried!r} by "
          "its prefix); `gateway keys list` lists them", file=sys.stderr)
    return True


def _edited(args: argparse.Namespace, edit: Any) -> tuple[Any, int]:
    """`edit(backend, key_id)` run on the key `args` names: (its result, 0), or (None, the
    exit code) once the failure is said (no such key, a refused edit, a concurrent one)."""
    from gateway.policy import admin
    if _a_secret(args.key_id):
        return None, 2
    try:
        return run_value(edit(_backend(_settings(args)), args.key_id)), 0
    except KeyError:
        print(f"error: no key {args.key_id}", file=sys.stderr)
        return None, 2
    except (PolicyError, ValueError) as exc:
        print(f"error, nothing published: {exc}", file=sys.stderr)
        return None, 2
    except admin.RevisionConflict as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None, 1


def _key_edit(args: argparse.Namespace, edit: Any, verb: str, same: str) -> int:
    done, code = _edited(args, edit)
    if done is None:
        return code
    if done.changed:
        print(f"{verb} {args.key_id} in revision {done.revision}")
        _warn(done.warnings)
    else:
        print(f"{args.key_id} {same}: nothing changed (revision {done.revision})")
    return 0


def cmd_keys_show(args: argparse.Namespace) -> int:
    from gateway import keys_show
    from gateway.policy.model import Policy
    s = _settings(args)
    if _a_secret(args.key_id):
        return 2
    rev, doc = run_value(_backend(s).read())
    if args.key_id not in doc.keys:
        print(f"error: no key {args.key_id}", file=sys.stderr)
        return 2
    policy = Policy.compile(doc, rev)
    now = time.time()

    async def read() -> list[Any]:
        tiers = keys_show.key_tiers(policy, args.key_id)
        if not s.redis_url:
            return await keys_show.standings(tiers, None, now)
        from gateway.limits.redis_store import RedisLimiter
        from gateway.redis_clients import limiter_client
        limiter = RedisLimiter(limiter_client(s.redis_url, s.redis_deadline_ms / 1000))
        try:
            return await keys_show.standings(tiers, limiter.counters, now)
        finally:
            await limiter.close()
    try:
        rows = run_value(read())
    except Exception as exc:  # the store away: say it, exit non-zero
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data = keys_show.as_data(policy, args.key_id, rows, now, counters=bool(s.redis_url))
    print(orjson.dumps(data).decode() if args.output == "json" else keys_show.table(data))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from gateway.policy import admin
    return _key_edit(args, admin.revoke_key, "revoked", "is already revoked")


def cmd_keys_enable(args: argparse.Namespace) -> int:
    from gateway.policy import admin
    return _key_edit(args, admin.enable_key, "re-enabled", "is already enabled")


def limit_number(text: str, none_removes: bool = False) -> int | float:
    """A limit flag's number, read as the policy file reads a limit (`1e6` is 1000000, an
    int). Text that spells none is refused naming it, with the number it likely means
    (`'10k' is not a number: write 10000`), as `policy apply` refuses it in a file; nan
    and inf too (they would be published as null, i.e. no limit at all)."""
    from gateway.policy.schema import NotANumber, read_number
    finite = f"{text!r} is not a finite number" + (" (`none` removes the limit)"
                                                   if none_removes else "")
    try:
        value = read_number(text)
    except NotANumber as exc:
        try:
            float(text)  # nan, inf: numbers to a float, but no limit can be one
        except ValueError:
            fix = f": write {exc.fix}" if exc.fix else ""
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number{' or `none`' if none_removes else ''}{fix}"
            ) from None
        raise argparse.ArgumentTypeError(finite) from None
    if not math.isfinite(value):  # 1e999: beyond a double
        raise argparse.ArgumentTypeError(finite)
    return value


def whole_limit(text: str) -> int:
    """A limit flag counting requests or tokens: a whole number (`1e6`, `2000000`)."""
    from gateway.policy.schema import not_a_count
    value = limit_number(text)
    if isinstance(value, float) and (problem := not_a_count(value)):
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return int(value)


def objective_flag(text: str) -> str:
    """--inference-objective's name, refused at once as the policy would refuse it."""
    from gateway.policy.schema import objective_name
    try:
        return objective_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def limit_value(text: str) -> float | None:
    """A limit flag's value: a number (as `limit_number` reads it), or `none` to remove
    that limit."""
    if text.strip().lower() == "none":
        return None
    return limit_number(text, none_removes=True)


def cmd_keys_update(args: argparse.Namespace) -> int:
    from gateway.policy import admin
    from gateway.policy.schema import not_a_count
    limits = {name: getattr(args, name) for name in admin.LIMIT_FIELDS
              if getattr(args, name) is not admin.UNSET}
    for name, value in limits.items():
        if name != "rps" and isinstance(value, float) and (problem := not_a_count(value)):
            print(f"error: --{name.replace('_', '-')} {value:g} {problem}", file=sys.stderr)
            return 2
    models: Any = admin.UNSET
    if args.models is not None:
        models = None if args.models == "team" else [m for m in args.models.split(",") if m]
    expires: Any = admin.UNSET
    try:
        if args.no_expiry:
            expires = None
        elif args.expires_in:
            expires = admin.expiry(args.expires_in)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    objective: Any = admin.UNSET
    if args.no_inference_objective:
        objective = None
    elif args.inference_objective is not None:
        objective = args.inference_objective
    if not limits and models is admin.UNSET and expires is admin.UNSET \
            and objective is admin.UNSET:
        print("error: nothing to update: give limits (--rps ...), --models, --expires-in, "
              "--no-expiry, --inference-objective or --no-inference-objective",
              file=sys.stderr)
        return 2

    def edit(backend: Any, key_id: str) -> Any:
        return admin.update_key(backend, key_id, limits=limits, models=models,
                                expires_at=expires, inference_objective=objective)
    return _key_edit(args, edit, "updated", "already has these settings")
