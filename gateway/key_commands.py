"""`gateway keys ...`: the operator's commands on one key of a spoke's policy (create, mint,
list, show, update, rotate, revoke, enable), and the parsers of their limit flags."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import orjson

from gateway.errors import PolicyError
from gateway.policy_commands import policy_backend, read_policy, run_value, warn
from gateway.settings import cli_settings as _settings


def cmd_keys_create(args: argparse.Namespace) -> int:
    from gateway.policy import key_edits
    limits = {"rps": args.rps, "concurrency": args.concurrency,
              "tokens_per_day": args.tokens_per_day, "tokens_per_minute": args.tokens_per_minute}
    models = [m for m in (args.models or "").split(",") if m] or None
    try:
        new = run_value(key_edits.create_key(
            policy_backend(_settings(args)), args.team, key_id=args.key_id, models=models,
            expires_in=args.expires_in, limits=limits,
            inference_objective=args.inference_objective))
    except (PolicyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"key_id:   {new.key_id}\nrevision: {new.revision}\nsecret:   {new.secret}")
    print("The secret is shown once; only its SHA-256 is stored.", file=sys.stderr)
    warn(new.warnings)
    return 0


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    """A new secret for the key (printed once, as `keys create` prints one); the one it
    replaces stays valid for `--grace`."""
    from gateway.policy import key_edits
    from gateway.policy.schema import utc_text
    done, code = _edited(args, lambda backend, key_id: key_edits.rotate_key(backend, key_id,
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
    from gateway.policy import key_edits
    _, doc = read_policy(args)
    rows = key_edits.key_rows(doc)
    if args.output == "json":
        print(orjson.dumps(rows).decode())
        return 0
    print(f"{'KEY_ID':20} {'TEAM':16} {'STATE':9} {'EXPIRES':26} {'OLD SECRET UNTIL':22} "
          f"{'OBJECTIVE':20} MODELS")
    for r in rows:
        print(f"{r['key_id']:20} {r['team']:16} {r['state']:9} {r['expires_at']:26} "
              f"{r['old_secret_until']:22} {r['inference_objective'] or '-':20} {r['models']}")
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
        return run_value(edit(policy_backend(_settings(args)), args.key_id)), 0
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
        warn(done.warnings)
    else:
        print(f"{args.key_id} {same}: nothing changed (revision {done.revision})")
    return 0


def cmd_keys_show(args: argparse.Namespace) -> int:
    from gateway import keys_show
    from gateway.policy.model import Policy
    s = _settings(args)
    if _a_secret(args.key_id):
        return 2
    rev, doc = run_value(policy_backend(s).read())
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
    from gateway.policy import key_edits
    return _key_edit(args, key_edits.revoke_key, "revoked", "is already revoked")


def cmd_keys_enable(args: argparse.Namespace) -> int:
    from gateway.policy import key_edits
    return _key_edit(args, key_edits.enable_key, "re-enabled", "is already enabled")


def limit_number(text: str, none_removes: bool = False) -> int | float:
    """A limit flag's number, read as the policy file reads a limit (`1e6` is 1000000, an
    int). Text that spells none is refused naming it, with the number it likely means
    (`'10k' is not a number: write 10000`), as `policy apply` refuses it in a file; nan
    and inf too (they would be published as null, i.e. no limit at all)."""
    from gateway.policy.fields import NotANumber, read_number
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
    from gateway.policy.fields import not_a_count
    value = limit_number(text)
    if isinstance(value, float) and (problem := not_a_count(value)):
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return int(value)


def objective_flag(text: str) -> str:
    """--inference-objective's name, refused at once as the policy would refuse it."""
    from gateway.policy.fields import objective_name
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
    from gateway.policy import key_edits
    from gateway.policy.fields import not_a_count
    limits = {name: getattr(args, name) for name in key_edits.LIMIT_FIELDS
              if getattr(args, name) is not key_edits.UNSET}
    for name, value in limits.items():
        if name != "rps" and isinstance(value, float) and (problem := not_a_count(value)):
            print(f"error: --{name.replace('_', '-')} {value:g} {problem}", file=sys.stderr)
            return 2
    models: Any = key_edits.UNSET
    if args.models is not None:
        models = None if args.models == "team" else [m for m in args.models.split(",") if m]
    expires: Any = key_edits.UNSET
    try:
        if args.no_expiry:
            expires = None
        elif args.expires_in:
            expires = key_edits.expiry(args.expires_in)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    objective: Any = key_edits.UNSET
    if args.no_inference_objective:
        objective = None
    elif args.inference_objective is not None:
        objective = args.inference_objective
    if not limits and models is key_edits.UNSET and expires is key_edits.UNSET \
            and objective is key_edits.UNSET:
        print("error: nothing to update: give limits (--rps ...), --models, --expires-in, "
              "--no-expiry, --inference-objective or --no-inference-objective",
              file=sys.stderr)
        return 2

    def edit(backend: Any, key_id: str) -> Any:
        return key_edits.update_key(backend, key_id, limits=limits, models=models,
                                expires_at=expires, inference_objective=objective)
    return _key_edit(args, edit, "updated", "already has these settings")
