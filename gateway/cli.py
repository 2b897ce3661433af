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
from gateway.cli_tools import add_tools, positive, positive_seconds, store_flags
from gateway.envoy_contract import RECORDS_FLUSH_MS
from gateway.errors import ListenError, PolicyError, SpoolLocked, SpoolUnusable
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
    if s.workers > 1 or s.door_workers:
        if s.embedded:
            what = "GATEWAY_WORKERS > 1" if s.workers > 1 else "GATEWAY_DOOR_WORKERS"
            raise SystemExit(f"{what} needs Redis (GATEWAY_REDIS_URL): in-process counters "
                             "are per process")
        if s.door_workers and not s.authz_http_listen:
            raise SystemExit("GATEWAY_DOOR_WORKERS needs the HTTP door "
                             "(GATEWAY_AUTHZ_HTTP_LISTEN is empty)")
        from gateway.server.workers import run_workers
        return run_workers(s)
    import uvloop

    from gateway.server.app import run
    uvloop.run(run(s))
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from gateway.envoyconf.bootstrap import EnvoyPorts, render
    from gateway.metering.sources import source_named
    door = None if args.grpc_check else args.authz_http
    if args.records_http and not source_named(args.metering).records_are_events:
        print("note: --records-http is the Envoy source's: with ext_proc the early-end "
              "records go over gRPC to --sidecar, with the streams", file=sys.stderr)
    sys.stdout.write(render(EnvoyPorts(listen=args.listen, sidecar=args.sidecar,
                                       engine=args.engine, admin=args.admin, otlp=args.otlp,
                                       authz_http=door, records_http=args.records_http),
                            metering=args.metering, heartbeat_s=args.record_heartbeat_s,
                            keep_request_ids=args.keep_request_ids,
                            records_flush_s=args.records_flush_ms / 1000))
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
  gateway keys rotate KEY_ID --grace 24h       # a new secret; the old one ends in 24 h
  gateway usage consume --until-caught-up && gateway usage report --by key -o csv
"""


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
    p.add_argument("--door-workers", dest="door_workers", type=int, default=None,
                   help="more processes serving only the HTTP door, so a Check never waits "
                        "behind Envoy's records (default: $GATEWAY_DOOR_WORKERS, else 0)")
    store_flags(p)
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

    add_tools(sub)

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
    p.add_argument("--record-heartbeat-s", dest="record_heartbeat_s", type=positive_seconds,
                   default=10.0,
                   help="Envoy-fed metering: a record of each request in flight this often, "
                        "the sidecar's proof it lives (= its GATEWAY_RECORD_HEARTBEAT_S; "
                        "default: %(default)s)")
    p.add_argument("--records-http", dest="records_http", default=None, metavar="HOST:PORT",
                   help="Envoy's records go over OTLP/HTTP to the sidecar's "
                        "GATEWAY_RECORDS_HTTP_LISTEN there: cheaper than gRPC, but Envoy "
                        "never retries them, so a sidecar crash loses a batch in flight "
                        "(default: gRPC to --sidecar, retried). Envoy source only: with "
                        "ext_proc the records go over gRPC, on the connection of the "
                        "streams they tell about")
    p.add_argument("--records-flush-ms", dest="records_flush_ms", type=positive("milliseconds"),
                   default=RECORDS_FLUSH_MS, metavar="MS",
                   help="Envoy sends its records every MS milliseconds: shorter frees "
                        "concurrency slots sooner and shortens the sidecar's tail, longer "
                        "costs it less CPU a request; keep it under "
                        "GATEWAY_CONCURRENCY_GRACE_MS (default: %(default)g)")
    p.add_argument("--keep-request-ids", dest="keep_request_ids", action="store_true",
                   help="keep a client's own x-request-id (behind a trusted front proxy): "
                        "a live duplicate is refused with 409 (default: Envoy's own ids)")
    _metering_flag(p)
    p.set_defaults(fn=cmd_envoy_config)
    _name_commands(ap)
    return ap


def _name_commands(ap: argparse.ArgumentParser) -> None:
    """Each command group's metavar is its choices, as its help already shows them, so a
    missing command is named by them (`required: {apply,show,status,sync}`), not by the
    internal dest (`required: sub`)."""
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            if action.metavar is None:
                action.metavar = "{" + ",".join(action.choices) + "}"
            for sub in dict.fromkeys(action.choices.values()):
                _name_commands(sub)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is seen below
        return code
    except BrokenPipeError:  # `| head` has what it wanted: stop quietly, as head(1)'s writer
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
    except KeyboardInterrupt:  # Ctrl-C in a short command: stopped, no traceback
        return 130
    except PolicyError as exc:  # the stored policy (embedded mode's file) does not read
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except AddressError as exc:  # a listen address or an upstream that is not host:port
        print(f"error: {exc} (its flag or setting)", file=sys.stderr)
        return 2
    except (SpoolLocked, SpoolUnusable, ListenError) as exc:  # serve: its spool, its ports
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except _redis_error() as exc:  # the spoke's Redis away, refusing, or no primary known
        # redis-py's MasterNotFoundError ends in the repr of every Sentinel's client: cut it
        said = str(exc).split(" : <redis", 1)[0]
        print(f"error: redis: {said} (is GATEWAY_REDIS_URL / --redis-url right, and Redis up?)",
              file=sys.stderr)
        return 1


def _redis_error() -> type[Exception]:
    """Imported only when a command failed: the commands that never touch Redis (envoy-config,
    keys mint) start without loading the client."""
    from redis.exceptions import RedisError
    return RedisError
