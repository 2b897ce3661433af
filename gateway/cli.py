"""gateway: the auth-and-metering sidecar for LLM serving, and its operator tools.

Commands and flags: docs/contracts.md. Settings not given as flags come from GATEWAY_*
environment variables (each flag below names its own)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from gateway.addresses import AddressError, split_hostport
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
from gateway.policy_commands import (
    cmd_keys_create,
    cmd_keys_enable,
    cmd_keys_list,
    cmd_keys_mint,
    cmd_keys_revoke,
    cmd_keys_show,
    cmd_keys_update,
    cmd_policy_apply,
    cmd_policy_show,
    cmd_policy_status,
    limit_value,
)
from gateway.settings import REFERENCE_AUTHZ_HTTP, REFERENCE_LISTEN, cli_settings

_settings = cli_settings


def _run(coro: Coroutine[Any, Any, int]) -> int:
    return asyncio.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.server.proto_fields import check_or_exit
    check_or_exit()  # a message lacking a field we read: refuse, with the fix
    s = _settings(args)
    for value, name in ((s.listen, "GATEWAY_LISTEN"), (s.authz_http_listen,
                        "GATEWAY_AUTHZ_HTTP_LISTEN"), (s.records_http_listen,
                        "GATEWAY_RECORDS_HTTP_LISTEN"), (s.metrics_listen,
                        "GATEWAY_METRICS_LISTEN")):
        if value:  # refused before anything binds or connects (exit 2, see main)
            split_hostport(value, name)
    from gateway.log import configure
    configure(s.log_level)
    if s.workers > 1:
        if s.embedded:
            raise SystemExit("GATEWAY_WORKERS > 1 needs Redis: in-process counters are per process")
        from gateway.server.workers import run_workers
        run_workers(s)
        return 0
    import uvloop

    from gateway.server.app import run
    uvloop.run(run(s))
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from gateway.envoyconf.bootstrap import EnvoyPorts, render
    door = None if args.grpc_check else args.authz_http
    sys.stdout.write(render(EnvoyPorts(listen=args.listen, sidecar=args.sidecar,
                                       engine=args.engine, admin=args.admin, otlp=args.otlp,
                                       authz_http=door, records_http=args.records_http),
                            metering=args.metering, heartbeat_s=args.record_heartbeat_s,
                            keep_request_ids=args.keep_request_ids))
    return 0


FROM_A_CHECKOUT = ("gateway dev: the local spoke (mock engine, Envoy, Redis, broker) runs from a "
                   "checkout of the gateway repository, not from an installed package; in the "
                   "checkout, run: make run\n")


def cmd_dev(args: argparse.Namespace) -> int:
    # The local spoke (devspoke/, with the mock engine) is no part of the wheel: `make run`'s
    # venv finds it in the checkout (scripts/bootstrap.sh's .pth).
    try:
        from devspoke.spoke import run_spoke
    except ModuleNotFoundError as exc:
        if exc.name != "devspoke":
            raise
        sys.stderr.write(FROM_A_CHECKOUT)
        return 2
    return run_spoke(port=args.port, workdir=Path(args.workdir), otlp=args.otlp,
                     metering=args.metering, drain_s=args.drain_s)


def _store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", dest="redis_url", default=None,
                   help="the spoke's Redis (default: $GATEWAY_REDIS_URL; unset: embedded mode)")
    p.add_argument("--policy-file", dest="policy_file", default=None,
                   help="embedded mode's policy file (default: $GATEWAY_POLICY_FILE)")


def _hub_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", default=None,
                   help="the hub's Kafka (default: $GATEWAY_HUB_BOOTSTRAP, else "
                        "$GATEWAY_KAFKA_BOOTSTRAP)")


def _metering_flag(p: argparse.ArgumentParser) -> None:
    from gateway.settings import DEFAULT_METERING, METERING_SOURCES
    p.add_argument("--metering", choices=METERING_SOURCES,
                   default=os.environ.get("GATEWAY_METERING", DEFAULT_METERING),
                   help="who does the per-chunk work: Envoy's own filters with one record per "
                        "request to the sidecar, or the sidecar through ext_proc "
                        "(default: $GATEWAY_METERING, else %(default)s)")


EXAMPLES = """examples:
  gateway dev                                  # the whole local spoke on 127.0.0.1:10000
  gateway policy apply policy.yaml --dry-run   # what a new revision would change
  gateway keys create --team team-a --rps 2    # a key; its secret is printed once
  gateway usage consume --until-caught-up && gateway usage report --by key -o csv
"""


def admin_unset() -> Any:
    from gateway.policy.admin import UNSET
    return UNSET


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gateway", description=__doc__, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="run the sidecar (ext_authz + ext_proc + health)")
    p.add_argument("--listen", default=None,
                   help="ext_authz, ext_proc, records and health, gRPC "
                        "(default: $GATEWAY_LISTEN, else 127.0.0.1:9001)")
    p.add_argument("--authz-http-listen", dest="authz_http_listen", default=None,
                   help="ext_authz's HTTP door, the reference config's Check (default: "
                        "$GATEWAY_AUTHZ_HTTP_LISTEN, else 127.0.0.1:9002; empty: not served)")
    p.add_argument("--records-http-listen", dest="records_http_listen", default=None,
                   help="Envoy's records over OTLP/HTTP, for `envoy-config --records-http` "
                        "(default: $GATEWAY_RECORDS_HTTP_LISTEN, else not served)")
    p.add_argument("--metrics-listen", dest="metrics_listen", default=None,
                   help="/metrics, /healthz, /readyz (default: $GATEWAY_METRICS_LISTEN, "
                        "else 127.0.0.1:9102)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes sharing the port (default: $GATEWAY_WORKERS, else 1)")
    _store_flags(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("dev", help="the whole local spoke in one command (from a checkout)")
    p.add_argument("--port", type=int, default=10000,
                   help="Envoy's listener on 127.0.0.1 (default: %(default)s)")
    p.add_argument("--drain-s", dest="drain_s", type=float, default=5.0,
                   help="on Ctrl-C, requests in flight get this long to finish before the "
                        "rest are cut (each still gets its usage event; default: %(default)s)")
    p.add_argument("--workdir", default=".gateway-dev",
                   help="logs, configs and spools of this spoke (default: %(default)s)")
    p.add_argument("--otlp", default=None, metavar="HOST:PORT",
                   help="send Envoy's and the sidecar's traces to this OTLP/gRPC collector")
    _metering_flag(p)
    p.set_defaults(fn=cmd_dev)

    pol = sub.add_parser("policy", help="apply / show / status / sync").add_subparsers(
        dest="sub", required=True)
    p = pol.add_parser("apply", help="validate and publish a new revision")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print what would change; publish nothing")
    p.add_argument("--prune", action="store_true",
                   help="allow removing keys the current revision has (default: refuse)")
    p.add_argument("--allow-empty", dest="allow_empty", action="store_true",
                   help="allow a document with no models or no keys (default: refuse)")
    p.add_argument("file", help="YAML or JSON policy document; - reads stdin")
    _store_flags(p)
    p.set_defaults(fn=cmd_policy_apply)
    p = pol.add_parser("show", help="the current revision as appliable YAML")
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml",
                   help="format (default: %(default)s)")
    _store_flags(p)
    p.set_defaults(fn=cmd_policy_show)
    p = pol.add_parser("status", help="each instance: revision held, ACK/NACK, last seen")
    _store_flags(p)
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
    _store_flags(p)
    p.set_defaults(fn=cmd_policy_sync)

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
        "keys", help="create / mint / list / show / update / revoke / enable").add_subparsers(
        dest="sub", required=True)
    p = keys.add_parser("create", help="make a key; prints the secret once")
    p.add_argument("--team", required=True, help="the team the key belongs to (must exist)")
    p.add_argument("--key-id", dest="key_id", default=None,
                   help="1-64 letters, digits or '_' (default: key_ + 8 random hex)")
    p.add_argument("--models", default=None, help="comma-separated globs; narrows the team's")
    p.add_argument("--expires-in", dest="expires_in", default=None, help="e.g. 30d")
    p.add_argument("--rps", type=float, default=None,
                   help="requests per second (default: no key-tier limit)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default: no key-tier limit)")
    p.add_argument("--tokens-per-minute", dest="tokens_per_minute", type=int, default=None,
                   help="prompt + completion tokens, sliding minute (default: no limit)")
    p.add_argument("--tokens-per-day", dest="tokens_per_day", type=int, default=None,
                   help="prompt + completion tokens per UTC day (default: no limit)")
    _store_flags(p)
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
    _store_flags(p)
    p.set_defaults(fn=cmd_keys_list)
    p = keys.add_parser("show", help="a key's limits at each tier, and what is used and left "
                                     "now in each window")
    p.add_argument("key_id", help="the key")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table",
                   help="format (default: %(default)s)")
    _store_flags(p)
    p.set_defaults(fn=cmd_keys_show)
    p = keys.add_parser("revoke", help="disable a key (new revision; a revoked key: no change)")
    p.add_argument("key_id", help="the key to disable")
    _store_flags(p)
    p.set_defaults(fn=cmd_keys_revoke)
    p = keys.add_parser("enable", help="re-enable a revoked key (new revision)")
    p.add_argument("key_id", help="the key to enable")
    _store_flags(p)
    p.set_defaults(fn=cmd_keys_enable)
    p = keys.add_parser("update", help="change a key's limits, models or expiry (new revision)")
    p.add_argument("key_id", help="the key to change")
    for name, kind in (("rps", "requests per second"), ("burst", "requests at once (rps)"),
                       ("concurrency", "requests in flight"),
                       ("tokens_per_minute", "tokens, sliding minute"),
                       ("tokens_per_day", "tokens per UTC day"),
                       ("tokens_per_month", "tokens per UTC month")):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=limit_value,
                       default=admin_unset(), metavar="N|none",
                       help=f"the key tier's {kind}; none removes it (default: unchanged)")
    p.add_argument("--models", default=None,
                   help="comma-separated globs (narrow the team's); `team`: the team's, "
                        "unnarrowed (default: unchanged)")
    exp = p.add_mutually_exclusive_group()
    exp.add_argument("--expires-in", dest="expires_in", default=None,
                     help="expire this long from now, e.g. 30d (default: unchanged)")
    exp.add_argument("--no-expiry", dest="no_expiry", action="store_true",
                     help="never expire")
    _store_flags(p)
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
    p.add_argument("--count", type=int, default=0, help="stop after N new events")
    p.add_argument("--until-caught-up", dest="until_caught_up", action="store_true",
                   help="stop once the topic has nothing more for this group (cron jobs); "
                        "progress goes to stderr either way")
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
    p.add_argument("--interval-s", dest="interval_s", type=float, default=5.0,
                   help="seconds between allocations (default: %(default)s); a spoke's "
                        "report that frees a share is acted on at once")
    p.add_argument("--bootstrap", default=None,
                   help="Kafka bootstrap servers (default: $GATEWAY_HUB_BOOTSTRAP, else "
                        "$GATEWAY_KAFKA_BOOTSTRAP)")
    p.set_defaults(fn=cmd_hub_allocate)

    p = sub.add_parser("envoy-config", help="print the Envoy bootstrap YAML")
    p.add_argument("--listen", default="127.0.0.1:10000",
                   help="Envoy's listener, an IP and port (default: %(default)s)")
    p.add_argument("--sidecar", default=REFERENCE_LISTEN,
                   help="the sidecar's gRPC address: records, ext_proc, health "
                        "(default: %(default)s)")
    door = p.add_mutually_exclusive_group()
    door.add_argument("--authz-http", dest="authz_http", default=REFERENCE_AUTHZ_HTTP,
                      metavar="HOST:PORT",
                      help="ext_authz's Checks go to the sidecar's HTTP door there (its "
                           "GATEWAY_AUTHZ_HTTP_LISTEN): the same decisions at a fraction of "
                           "gRPC's cost (default: %(default)s)")
    door.add_argument("--grpc-check", dest="grpc_check", action="store_true",
                      help="ext_authz's Checks go to the gRPC Check at --sidecar instead "
                           "(for managed gateways, where only gRPC ext_authz attaches)")
    p.add_argument("--engine", default="127.0.0.1:8000",
                   help="the OpenAI-compatible engine, host:port (default: %(default)s)")
    p.add_argument("--admin", default="127.0.0.1:9901",
                   help="Envoy's admin interface, loopback only (default: %(default)s)")
    p.add_argument("--otlp", default=None, metavar="HOST:PORT",
                   help="an OTLP/gRPC collector for Envoy's traces (default: no tracing)")
    p.add_argument("--record-heartbeat-s", dest="record_heartbeat_s", type=float, default=10.0,
                   help="Envoy-fed metering: a record of each request in flight this often, "
                        "the sidecar's proof it lives (= its GATEWAY_RECORD_HEARTBEAT_S; "
                        "default: %(default)s)")
    p.add_argument("--records-http", dest="records_http", default=None, metavar="HOST:PORT",
                   help="Envoy's records go over OTLP/HTTP to the sidecar's "
                        "GATEWAY_RECORDS_HTTP_LISTEN there: cheaper than gRPC, but Envoy "
                        "never retries them, so a sidecar crash loses a batch in flight "
                        "(default: gRPC to --sidecar, retried)")
    p.add_argument("--keep-request-ids", dest="keep_request_ids", action="store_true",
                   help="keep a client's own x-request-id (behind a trusted front proxy): "
                        "a live duplicate is refused with 409 (default: Envoy's own ids)")
    _metering_flag(p)
    p.set_defaults(fn=cmd_envoy_config)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        return int(args.fn(args))
    except AddressError as exc:  # a listen address or an upstream that is not host:port
        print(f"error: {exc} (its flag or setting)", file=sys.stderr)
        return 2
