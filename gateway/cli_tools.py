"""The operator tools' command lines: `gateway policy`, `hub`, `keys` and `usage` (their
grammar; the commands themselves live beside what they work on). `gateway.cli` adds them
beside the long-running processes (serve, dev) and envoy-config.

Commands and flags: docs/contracts.md §3."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from gateway.billing.commands import (
    cmd_usage_consume,
    cmd_usage_reconcile,
    cmd_usage_report,
    cmd_usage_tail,
)
from gateway.hub.commands import (
    cmd_hub_allocate,
    cmd_hub_forget,
    cmd_hub_publish,
    cmd_hub_status,
    cmd_hub_unpublish,
    cmd_policy_sync,
)
from gateway.key_commands import (
    cmd_keys_create,
    cmd_keys_enable,
    cmd_keys_list,
    cmd_keys_mint,
    cmd_keys_revoke,
    cmd_keys_rotate,
    cmd_keys_show,
    cmd_keys_update,
    limit_number,
    limit_value,
    objective_flag,
    whole_limit,
)
from gateway.policy_commands import (
    cmd_policy_apply,
    cmd_policy_check,
    cmd_policy_schema,
    cmd_policy_show,
    cmd_policy_status,
)


def _float(text: str) -> float:
    """A flag's number; nan for text that is none, which every range check below refuses."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def positive(unit: str) -> Callable[[str], float]:
    """A flag's amount of `unit`: above 0 and finite (nan passed `<= 0` checks)."""
    def parse(text: str) -> float:
        if not 0 < (value := _float(text)) < math.inf:
            raise argparse.ArgumentTypeError(f"not a positive number of {unit}: {text!r}")
        return value
    return parse


positive_seconds = positive("seconds")


def store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", dest="redis_url", default=None,
                   help="the spoke's Redis (default: $GATEWAY_REDIS_URL; unset: embedded mode)")
    p.add_argument("--policy-file", dest="policy_file", default=None,
                   help="embedded mode's policy file (default: $GATEWAY_POLICY_FILE)")


def _hub_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", default=None,
                   help="the hub's Kafka (default: $GATEWAY_HUB_BOOTSTRAP, else "
                        "$GATEWAY_KAFKA_BOOTSTRAP)")


def _admin_unset() -> Any:
    from gateway.policy.key_edits import UNSET
    return UNSET


def add_tools(sub: Any) -> None:
    """The policy, hub, keys and usage commands, on `gateway`'s subparsers."""
    pol = sub.add_parser("policy", help="apply / show / status / sync / schema").add_subparsers(
        dest="sub", required=True)
    p = pol.add_parser("apply", help="validate and publish a new revision")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print what would change; publish nothing")
    p.add_argument("--prune", action="store_true",
                   help="allow removing keys the current revision has (default: refuse)")
    p.add_argument("--allow-empty", dest="allow_empty", action="store_true",
                   help="allow a document with no models or no keys (default: refuse)")
    p.add_argument("file", help="YAML or JSON policy document; - reads stdin")
    store_flags(p)
    p.set_defaults(fn=cmd_policy_apply)
    p = pol.add_parser("show", help="the current revision as appliable YAML")
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml",
                   help="format (default: %(default)s)")
    store_flags(p)
    p.set_defaults(fn=cmd_policy_show)
    p = pol.add_parser("status", help="each instance: revision held, ACK/NACK, last seen")
    store_flags(p)
    p.set_defaults(fn=cmd_policy_status)

    p = pol.add_parser("sync", help="follow the hub's feed into this spoke's Redis "
                                    "(long-running)")
    p.add_argument("--id", default=None,
                   help="this syncer's name in `hub status` and `policy status` "
                        "(default: sync-<hostname>)")
    p.add_argument("--metrics-listen", dest="sync_metrics_listen", default=None,
                   help="/metrics and /healthz (default: $GATEWAY_SYNC_METRICS_LISTEN, else "
                        "127.0.0.1:9103)")
    p.add_argument("--bootstrap", dest="hub_bootstrap", default=None,
                   help="the hub's Kafka (default: $GATEWAY_HUB_BOOTSTRAP, else "
                        "$GATEWAY_KAFKA_BOOTSTRAP)")
    store_flags(p)
    p.set_defaults(fn=cmd_policy_sync)
    p = pol.add_parser("schema", help="print the policy document's JSON Schema (draft "
                                      "2020-12), for editors and CI; reads no store")
    p.set_defaults(fn=cmd_policy_schema)
    p = pol.add_parser("check", help="validate policy documents offline, as apply and hub "
                                     "publish do; reads no store (exit 2 if any is invalid)")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="YAML or JSON policy document; - reads stdin")
    p.set_defaults(fn=cmd_policy_check)

    hub = sub.add_parser(
        "hub", help="the hub's side: publish / unpublish / status / forget / allocate"
    ).add_subparsers(
        dest="sub", required=True)
    p = hub.add_parser("publish", help="validate a policy and put it on the feed as the next "
                                      "revision")
    p.add_argument("file", help="YAML or JSON policy document; - reads stdin")
    p.add_argument("--spoke", dest="target_spoke", default="*", metavar="ID|*",
                   help="the spoke it is for; * = every spoke without its own entry "
                        "(default: %(default)s)")
    p.add_argument("--allow-empty", action="store_true",
                   help="publish a document with no models or no keys (every spoke that "
                        "takes it refuses every request); without it such a file is refused, "
                        "exit 2, as `policy apply` does")
    _hub_flag(p)
    p.set_defaults(fn=cmd_hub_publish)
    p = hub.add_parser("unpublish", help="remove spokes' own entries from the feed: each "
                                        "follows '*' again")
    p.add_argument("spokes", nargs="+", metavar="SPOKE", help="a spoke with an entry of its own")
    _hub_flag(p)
    p.set_defaults(fn=cmd_hub_unpublish)
    p = hub.add_parser("status", help="the fleet, from the status topic: per spoke and "
                                     "instance, revision, ACK/NACK, spool, store")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table",
                   help="format (default: %(default)s)")
    _hub_flag(p)
    p.set_defaults(fn=cmd_hub_status)
    p = hub.add_parser("forget", help="remove instances that stopped reporting from `hub "
                                     "status` (a live one reappears with its next report)")
    p.add_argument("instances", nargs="+", metavar="SPOKE/INSTANCE",
                   help="as `hub status` lists them: the spoke, a slash, the instance")
    _hub_flag(p)
    p.set_defaults(fn=cmd_hub_forget)

    keys = sub.add_parser(
        "keys", help="create / mint / list / show / update / rotate / revoke / enable"
    ).add_subparsers(dest="sub", required=True)
    p = keys.add_parser("create", help="make a key; prints the secret once")
    p.add_argument("--team", required=True, help="the team the key belongs to (must exist)")
    p.add_argument("--key-id", dest="key_id", default=None,
                   help="1-64 letters, digits or '_' (default: key_ + 8 random hex)")
    p.add_argument("--models", default=None, help="comma-separated globs; narrows the team's")
    p.add_argument("--expires-in", dest="expires_in", default=None, help="e.g. 30d")
    p.add_argument("--rps", type=limit_number, default=None,
                   help="requests per second (default: no key-tier limit)")
    p.add_argument("--concurrency", type=whole_limit, default=None,
                   help="requests in flight (default: no key-tier limit)")
    p.add_argument("--tokens-per-minute", dest="tokens_per_minute", type=whole_limit, default=None,
                   help="prompt + completion tokens, sliding minute (default: no limit)")
    p.add_argument("--tokens-per-day", dest="tokens_per_day", type=whole_limit, default=None,
                   help="prompt + completion tokens per UTC day (default: no limit)")
    p.add_argument("--inference-objective", dest="inference_objective", type=objective_flag,
                   default=None, metavar="NAME",
                   help="the GIE InferenceObjective its requests name (the engine's "
                        "scheduling priority; default: its team's, if any)")
    store_flags(p)
    p.set_defaults(fn=cmd_keys_create)
    p = keys.add_parser("mint", help="a secret and its sha256 for a hand-written policy; "
                                     "publishes nothing")
    p.add_argument("key_id", help="1-64 letters, digits or '_' (no '-')")
    p.add_argument("--team", default="TEAM",
                   help="the team to write in the printed entry (default: %(default)s)")
    p.set_defaults(fn=cmd_keys_mint)
    p = keys.add_parser("list", help="list keys (never secrets)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table",
                   help="format (default: %(default)s)")
    store_flags(p)
    p.set_defaults(fn=cmd_keys_list)
    p = keys.add_parser("show", help="a key's limits at each tier, and what is used and left "
                                     "now in each window")
    p.add_argument("key_id", help="the key")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table",
                   help="format (default: %(default)s)")
    store_flags(p)
    p.set_defaults(fn=cmd_keys_show)
    p = keys.add_parser("revoke", help="disable a key (new revision; a revoked key: no change)")
    p.add_argument("key_id", help="the key to disable")
    store_flags(p)
    p.set_defaults(fn=cmd_keys_revoke)
    p = keys.add_parser("rotate", help="a new secret for the key (printed once; new revision); "
                                       "the old one stays valid for --grace")
    p.add_argument("key_id", help="the key: same id, limits, counters and events")
    p.add_argument("--grace", default="24h",
                   help="how long the old secret stays valid, e.g. 2h; 0: it ends now, and "
                        "so does any earlier one still in its grace (default: %(default)s)")
    store_flags(p)
    p.set_defaults(fn=cmd_keys_rotate)
    p = keys.add_parser("enable", help="re-enable a revoked key (new revision)")
    p.add_argument("key_id", help="the key to enable")
    store_flags(p)
    p.set_defaults(fn=cmd_keys_enable)
    p = keys.add_parser("update", help="change a key's limits, models, expiry or inference "
                                        "objective (new revision)")
    p.add_argument("key_id", help="the key to change")
    for name, kind in (("rps", "requests per second"), ("burst", "requests at once (rps)"),
                       ("concurrency", "requests in flight"),
                       ("tokens_per_minute", "tokens, sliding minute"),
                       ("tokens_per_day", "tokens per UTC day"),
                       ("tokens_per_month", "tokens per UTC month")):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=limit_value,
                       default=_admin_unset(), metavar="N|none",
                       help=f"the key tier's {kind}; none removes it (default: unchanged)")
    p.add_argument("--models", default=None,
                   help="comma-separated globs (narrow the team's); `team`: the team's, "
                        "unnarrowed (default: unchanged)")
    exp = p.add_mutually_exclusive_group()
    exp.add_argument("--expires-in", dest="expires_in", default=None,
                     help="expire this long from now, e.g. 30d (default: unchanged)")
    exp.add_argument("--no-expiry", dest="no_expiry", action="store_true",
                     help="never expire")
    obj = p.add_mutually_exclusive_group()
    obj.add_argument("--inference-objective", dest="inference_objective", type=objective_flag,
                     default=None, metavar="NAME",
                     help="the GIE InferenceObjective its requests name (default: unchanged)")
    obj.add_argument("--no-inference-objective", dest="no_inference_objective",
                     action="store_true",
                     help="drop the key's own objective: its team's applies, if any")
    store_flags(p)
    p.set_defaults(fn=cmd_keys_update)

    usage = sub.add_parser("usage", help="tail / consume / report / reconcile").add_subparsers(
        dest="sub", required=True)
    p = usage.add_parser("tail", help="print the usage events on the topic in time order, one "
                                     "JSON a line")
    p.add_argument("--kafka", dest="kafka_bootstrap", default=None,
                   help="bootstrap servers (default: $GATEWAY_KAFKA_BOOTSTRAP)")
    p.add_argument("-n", "--lines", dest="limit", type=int, default=None, metavar="N",
                   help="the last N events by time (default: all there are)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="then keep printing new ones as they arrive, in time order (default: "
                        "stop once the topic is read)")
    p.add_argument("--pretty", action="store_true", help="indented JSON")
    p.set_defaults(fn=cmd_usage_tail)
    p = usage.add_parser("consume", help="reference billing consumer (exactly-once totals)")
    p.add_argument("--kafka", dest="kafka_bootstrap", default=None,
                   help="bootstrap servers (default: $GATEWAY_KAFKA_BOOTSTRAP)")
    p.add_argument("--db", default="sqlite:///usage.db",
                   help="sqlite:///FILE or postgresql://... (default: %(default)s)")
    p.add_argument("--group", default="gateway-billing",
                   help="Kafka consumer group (default: %(default)s)")
    p.add_argument("--count", type=int, default=0,
                   help="stop once N or more new events are in: after the batch that reaches "
                        "N, not cut short (default: 0, no limit)")
    p.add_argument("--until-caught-up", dest="until_caught_up", action="store_true",
                   help="stop once the topic has nothing more for this group (cron jobs); "
                        "progress goes to stderr either way")
    p.add_argument("--session-timeout-s", dest="session_timeout_s", type=positive_seconds,
                   default=6.0,  # consumer.SESSION_TIMEOUT_S (not imported: aiokafka)
                   help="Kafka group session: how long a killed consumer's partitions wait "
                        "for another, and the longest one batch's database write may take; "
                        "Kafka brokers refuse under 6 by default (default: %(default)s)")
    p.set_defaults(fn=cmd_usage_consume)
    p = usage.add_parser("report", help="requests by outcome, billable tokens (cached "
                                       "included) and cost, per team, key and/or model, per "
                                       "day or month, for a period")
    p.add_argument("--db", default="sqlite:///usage.db",
                   help="sqlite:///FILE or postgresql://... (default: %(default)s)")
    p.add_argument("--by", default="team", metavar="team|key|model[,...]",
                   help="group by one or more, comma-separated, e.g. team,model "
                        "(default: %(default)s)")
    p.add_argument("--per", choices=["day", "month"], default=None,
                   help="a row per UTC day or month too (default: one row for the period)")
    p.add_argument("--since", default=None,
                   help="YYYY-MM-DD (UTC midnight) or RFC 3339, inclusive (default: all)")
    p.add_argument("--until", default=None,
                   help="YYYY-MM-DD or RFC 3339, exclusive (default: now)")
    p.add_argument("-o", "--output", choices=["table", "csv", "json"], default="table",
                   help="format (default: %(default)s)")
    p.set_defaults(fn=cmd_usage_report)
    p = usage.add_parser("reconcile", help="per instance: seq gaps, duplicates, still spooled")
    p.add_argument("--db", default="sqlite:///usage.db",
                   help="sqlite:///FILE or postgresql://... (default: %(default)s)")
    p.add_argument("--spool-dir", dest="spool_dir", default=None,
                   help="the sidecars' spools; must exist (default: $GATEWAY_SPOOL_DIR, "
                        "else .gateway-spool, else `gateway dev`'s .gateway-dev/spool)")
    p.set_defaults(fn=cmd_usage_reconcile)

    p = hub.add_parser("allocate", help="the reference allocator (long-running): divides "
                                        "each global quota into per-spoke allowances")
    p.add_argument("--interval-s", dest="interval_s", type=positive_seconds, default=5.0,
                   help="seconds between allocations (default: %(default)s); a spoke's "
                        "report that frees a share is acted on at once")
    p.add_argument("--bootstrap", default=None,
                   help="Kafka bootstrap servers (default: $GATEWAY_HUB_BOOTSTRAP, else "
                        "$GATEWAY_KAFKA_BOOTSTRAP)")
    p.set_defaults(fn=cmd_hub_allocate)
