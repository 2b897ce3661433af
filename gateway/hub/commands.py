"""`gateway hub ...` and `gateway policy sync`: the hub's reference tools and the spoke's
follower of the hub (DESIGN §10)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from gateway.errors import PolicyError, TopicRefused
from gateway.policy_commands import run_value
from gateway.settings import Settings, cli_settings
from gateway.tasks import stop_on_signals


def cmd_policy_sync(args: argparse.Namespace) -> int:
    import uvloop

    from gateway.hub.allowances import AllowanceFollower
    from gateway.hub.sync import default_id, run_sync
    from gateway.log import configure
    s = cli_settings(args)
    configure(s.log_level)
    if not s.redis_url or not s.feed_bootstrap:
        raise SystemExit("policy sync needs GATEWAY_REDIS_URL (the spoke) and "
                         "GATEWAY_HUB_BOOTSTRAP or GATEWAY_KAFKA_BOOTSTRAP (the hub's Kafka)")
    # The spoke's allowances of global quotas follow the hub beside its revisions.
    allowances = AllowanceFollower(s.feed_bootstrap, s.spoke, redis_url=s.redis_url,
                                   idempotence=s.kafka_idempotence,
                                   deadline=s.redis_deadline_ms / 1000,
                                   replication=s.topic_replication)
    uvloop.run(run_sync(s, args.id or default_id(), extra=[allowances.run],
                       allowances=allowances.state))
    return 0


def _hub_bootstrap(args: argparse.Namespace) -> tuple[Settings, str]:
    s = cli_settings(args)
    bootstrap = args.bootstrap or s.feed_bootstrap
    if not bootstrap:
        raise SystemExit("no hub Kafka: pass --bootstrap, or set GATEWAY_HUB_BOOTSTRAP or "
                         "GATEWAY_KAFKA_BOOTSTRAP")
    return s, bootstrap


def cmd_hub_publish(args: argparse.Namespace) -> int:
    from gateway.hub.publish import publish
    from gateway.log import configure
    s, bootstrap = _hub_bootstrap(args)
    configure(s.log_level, cache=False)  # warnings to stderr: stdout is the line tools read
    try:
        text = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
        revision = run_value(publish(bootstrap, text, args.file, args.target_spoke,
                                      idempotence=s.kafka_idempotence,
                                      allow_empty=args.allow_empty,
                                      replication=s.topic_replication,
                                      warn=lambda w: print(f"warning: {w}", file=sys.stderr)))
    except PolicyError as err:
        print("invalid policy, nothing published:", file=sys.stderr)
        for p in err.problems:
            print(f"  {err.source}: {p}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # ApplyRefused (empty, no --allow-empty) included
        print(f"nothing published: {exc}", file=sys.stderr)
        return 2
    except TopicRefused as exc:  # the feed not made, nor there: the operator's to make
        print(f"error: nothing published: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # Kafka away: say it, exit non-zero
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"published revision {revision} for spoke {args.target_spoke}")
    return 0


def cmd_hub_status(args: argparse.Namespace) -> int:
    from gateway.hub import feed, fleet
    from gateway.hub.topics import POLICY_TOPIC, STATUS_TOPIC, read_all
    s, bootstrap = _hub_bootstrap(args)

    async def fetch() -> tuple[dict[str, bytes], dict[str, bytes]]:
        return (feed.latest(await read_all(bootstrap, STATUS_TOPIC)),
                feed.latest(await read_all(bootstrap, POLICY_TOPIC)))

    try:
        statuses, policies = run_value(fetch())
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    view = fleet.fleet(statuses, policies, time.time())
    if args.output == "json":
        print(orjson.dumps(view).decode())
    else:
        sys.stdout.write(fleet.table(view, s.status_interval_s))
    return 0


def _delete_keys(args: argparse.Namespace, topic: str, keys: list[str],
                 missing: Callable[[list[str]], str], done: Callable[[str], str]) -> int:
    """A null value (compaction's delete) for each of `keys` on `topic`, all or none: if
    the topic does not hold one, nothing is written and `missing(those)` says so (exit 2);
    else `done(key)` for each. Kafka away: exit 1."""
    from gateway.hub import feed
    from gateway.hub.topics import produce, read_all
    s, bootstrap = _hub_bootstrap(args)

    async def delete() -> list[str]:
        held = feed.latest(await read_all(bootstrap, topic))
        absent = [k for k in keys if k not in held]
        if not absent:
            for key in keys:
                await produce(bootstrap, topic, key, None, idempotence=s.kafka_idempotence)
        return absent

    try:
        absent = run_value(delete())
    except Exception as exc:  # Kafka away: say it, exit non-zero
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if absent:
        print(missing(absent), file=sys.stderr)
        return 2
    for key in keys:
        print(done(key))
    return 0


def cmd_hub_forget(args: argparse.Namespace) -> int:
    """A null value for each SPOKE/INSTANCE that has reported: an instance that stopped for
    good (a host gone, a renamed syncer) leaves `hub status`."""
    from gateway.hub.topics import STATUS_TOPIC
    keys = list(dict.fromkeys(args.instances))  # each once, in the order given
    bad = [k for k in keys if "/" not in k.strip("/")]
    if bad:
        print(f"nothing forgotten: not SPOKE/INSTANCE: {', '.join(bad)}", file=sys.stderr)
        return 2
    return _delete_keys(
        args, STATUS_TOPIC, keys,
        lambda absent: f"nothing forgotten: no report from {', '.join(absent)} (see "
                       "`gateway hub status`)",
        lambda key: f"forgot {key}")


def cmd_hub_unpublish(args: argparse.Namespace) -> int:
    """A null value on each SPOKE's own feed entry (DESIGN §10: it removes that entry); the
    spoke then follows `*`'s, published again as the next revision where the spoke would
    otherwise hold the removed one (it never moves to a lower revision). One record per
    spoke, so not atomic: a run that fails part way says which were removed, and running
    it again completes it (an entry already removed counts as done)."""
    from gateway.hub.feed import EVERY_SPOKE
    from gateway.hub.publish import unpublish
    s, bootstrap = _hub_bootstrap(args)
    spokes = list(dict.fromkeys(args.spokes))
    if EVERY_SPOKE in spokes:
        print("nothing removed: '*' is every spoke's entry (publish a new revision instead)",
              file=sys.stderr)
        return 2
    try:
        done = run_value(unpublish(bootstrap, spokes, idempotence=s.kafka_idempotence,
                                   replication=s.topic_replication))
    except Exception as exc:  # Kafka away: say it, exit non-zero
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if done.absent:
        print(f"nothing removed: no entry of its own for {', '.join(done.absent)}, now or "
              "before (see `gateway hub status`)", file=sys.stderr)
        return 2
    follows = ("it follows '*'" if done.star else
               "no '*' entry to follow: it keeps what it holds until one is published")
    for spoke in spokes:
        done_before = " (already, by an earlier run)" if spoke in done.already else ""
        print(f"removed the feed entry of spoke {spoke}{done_before}: {follows}")
    if done.republished is not None:
        print(f"published '*' again as revision {done.republished}, above the removed "
              f"{'entries' if len(spokes) > 1 else 'entry'}")
    elif len(done.already) == len(spokes):
        print("nothing changed: an earlier run completed it")
    return 0


def cmd_hub_allocate(args: argparse.Namespace) -> int:
    import uvloop

    from gateway.hub.allocator import Allocator
    from gateway.log import configure
    s, bootstrap = _hub_bootstrap(args)
    configure(s.log_level)
    if args.interval_s <= 0:
        raise SystemExit(f"--interval-s must be > 0, not {args.interval_s}")
    allocator = Allocator(bootstrap, args.interval_s, s.kafka_idempotence,
                          usage_topic=s.usage_topic, replication=s.topic_replication)

    async def run() -> None:  # Ctrl-C or SIGTERM stops it between polls, as `policy sync`
        await allocator.run(stop_on_signals())
    uvloop.run(run())
    return 0
