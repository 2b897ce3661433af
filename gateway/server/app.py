"""Composition root: settings → stores → decision/metering core → gRPC + HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway import metrics, redis_clients
from gateway.addresses import binding, can_bind
from gateway.authz.check import Check
from gateway.authz.engine import AdmissionSettings, Authorizer
from gateway.clock import SystemClock
from gateway.errors import ListenError
from gateway.hub.status import Status, StatusReporter, now_text
from gateway.limits.ahead import AheadLimiter
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.types import Limiter
from gateway.log import log
from gateway.metering.recorder import Recorder, settlements
from gateway.ops_http import healthz, metrics_handler, serve_http
from gateway.policy.holder import FilePolicySync, PolicyHolder, RedisPolicySync
from gateway.policy.prices import Rates
from gateway.policy.store import PolicyStore
from gateway.server import authz_http, records_http
from gateway.server.authz_service import AuthorizationService
from gateway.server.extproc_service import ExternalProcessorService
from gateway.server.gc_tuning import tune_gc_after_startup
from gateway.server.records_service import RecordsService
from gateway.server.shared_gate import SharedGate
from gateway.server.usage_pipeline import UsagePipeline
from gateway.settings import Settings
from gateway.sinks.gate import UsageGate
from gateway.sinks.spool import Spool
from gateway.sinks.spools import choose_instance
from gateway.tasks import cancel_all, stop_on_signals, watched
from gateway.token_weights import TokenWeights
from gateway.tracing import Tracing
from gateway.tracing import from_env as tracing_from_env

# What one process serves. "all": everything (one process, or each of GATEWAY_WORKERS).
# With GATEWAY_DOOR_WORKERS, the door is split off: "door" processes serve only the HTTP
# Check (admission, its ledger, policy and status; no records, spool or gRPC), "records"
# processes the rest (gRPC: records, ext_proc, the gRPC Check, health). An admission made
# in a door process is ended by the records process's settlement in Redis, which the door
# process's renewal then finds gone (renew.lua), as between any two instances.
Role = Literal["all", "records", "door"]

# At a stop, the longest the ext_proc streams its gRPC server's stop cancelled are given to
# run their handlers to the end (each emits its event there).
STREAMS_DRAIN_S = 1.0


@dataclass
class App:
    settings: Settings
    instance_id: str
    role: Role = "all"
    holder: PolicyHolder = field(default_factory=PolicyHolder)
    limiter: Limiter | None = None
    sync: RedisPolicySync | FilePolicySync | None = None
    ledger: Ledger | None = None
    server: grpc.aio.Server | None = None
    http: asyncio.Server | None = None
    authz_http: asyncio.Server | None = None  # ext_authz's HTTP door, when configured
    records_http: asyncio.Server | None = None  # Envoy's records over OTLP/HTTP, when configured
    health: health.aio.HealthServicer | None = None  # type: ignore[name-defined]
    usage: UsagePipeline | None = None  # spool → shipper → Kafka (not in a door process)
    tracing: Tracing | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # what the watch loop last saw: spool depth, its oldest event's age, the store answering
    spool_depth: int = 0
    spool_oldest_s: float = 0.0
    store_up: bool = False
    reporter: StatusReporter | None = None  # to the hub, when it has a Kafka
    recorder: Recorder | None = None  # the usage events (not in a door process)
    extproc: ExternalProcessorService | None = None  # its streams, drained at a stop
    # Closed while usage cannot be written (the spool's, or in a door process any records
    # process's, group commits fail): the Check refuses new requests, /readyz is not ready.
    gate: UsageGate = field(default_factory=UsageGate)
    # With GATEWAY_DOOR_WORKERS: one flag per records process in memory shared by all the
    # workers (gateway/server/workers.py); a records process writes its own, a door process
    # follows them all. (Shared memory: a file flag could not be made on the full disk.)
    shared_gate: SharedGate | None = None

    async def start(self, serve_http_endpoints: bool = True) -> None:
        try:
            await self._start(serve_http_endpoints)
        except ListenError:  # stop what began before the taken address: no noise at exit
            with contextlib.suppress(Exception):
                await self.stop(0)
            raise

    async def _start(self, serve_http_endpoints: bool) -> None:
        s = self.settings
        clock = SystemClock()
        self.gate.listeners.append(_gate_metric)
        metrics.SPOOL_WRITABLE.set(1)
        self.instance_id = choose_instance(s.spool_dir, self.instance_id)
        if s.embedded:
            if s.policy_file is None:
                raise SystemExit("embedded mode needs GATEWAY_POLICY_FILE (or GATEWAY_REDIS_URL)")
            self.limiter = MemoryLimiter(lease_ttl=s.lease_ttl_s, start_ttl=s.lease_start_ttl_s)
            if s.admit_ahead_ms > 0:  # in-process counters: there is no round trip to save
                log.warning("admit_ahead_ignored", reason="embedded mode has no Redis")
            self.sync = FilePolicySync(self.holder, s.policy_file)
            self.sync.refresh()
        else:
            assert s.redis_url
            deadline = s.redis_deadline_ms / 1000
            self.limiter = RedisLimiter(
                redis_clients.limiter_client(s.redis_url, deadline), s.lease_ttl_s,
                s.lease_start_ttl_s, deadline, orphan_grace=s.orphan_grace_s)
            if s.admit_ahead_ms > 0:
                self.limiter = AheadLimiter(self.limiter, s.admit_ahead_ms / 1000)
            store = PolicyStore(redis_clients.policy_client(s.redis_url, deadline))
            self.sync = RedisPolicySync(self.holder, store, self.instance_id, s.policy_recheck_s)
            await self.sync.refresh()
        self.sync.start()
        # Envoy-fed metering has no stream in the sidecar to renew a lease from: an admission
        # is renewed while Envoy's heartbeat records say the request lives, until its end.
        self.ledger = Ledger(self.limiter, clock, s.lease_ttl_s, s.lease_start_ttl_s,
                             watches=s.source.watches, unheard_s=s.unheard_s,
                             max_lifetime_s=s.admission_max_lifetime_s,
                             hears=self.role != "door")
        self.ledger.start()
        if isinstance(self.limiter, AheadLimiter):  # a live request id takes no ticket
            ledger = self.ledger
            self.limiter.follows = lambda request_id: ledger.stage(request_id) is not None
        door_only = self.role == "door"
        recorder = self.recorder = (None if door_only
                                    else self._start_usage_pipeline(self.ledger))
        if self.shared_gate is not None:  # after the spool opened: it can write
            self.shared_gate.follow(self.gate, door_only, self.tasks)
        if door_only:  # no spool to watch; whether Redis answers still goes to the hub
            self.tasks.append(watched(self._watch([]), "watch"))
        if s.feed_bootstrap:  # status up to the hub (DESIGN §10)
            self.store_up, _ = await self._store_answers()
            self.reporter = StatusReporter(s.feed_bootstrap, self.status, s.status_interval_s,
                                           s.kafka_idempotence, s.topic_replication)
            self.holder.on_change.append(self.reporter.poke)
            self.tasks.append(watched(self.reporter.run(), "status_reporter"))
        authorizer = Authorizer(self.holder.get, self.limiter, clock, AdmissionSettings(
            default_completion_tokens=s.default_completion_tokens,
            reserve_cap=s.reserve_cap_tokens,
            continuous_models=s.continuous_models,
            concurrency_grace_s=s.concurrency_grace_s,
        ), ledger=self.ledger, gate=self.gate)
        opts = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        self.tracing = tracing_from_env()
        # the one Check, whichever door Envoy uses; with ext_proc metering it emits the event
        # of a HEAD it refuses (no body: no ext_proc stream), in a process with a spool
        check = Check(authorizer, self.tracing, bodiless=None if s.source.records_are_events
                      else recorder)
        serves_door = bool(s.authz_http_listen) and self.role != "records"
        records = None
        if recorder is not None:
            self.server = grpc.aio.server(options=opts)
            AuthorizationService(check).register(self.server)
            self.extproc = ExternalProcessorService(recorder, self.ledger, self.tracing)
            external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
                self.extproc, self.server)
            # Envoy-fed metering's records; with ext_proc, Envoy's word on how a cut stream
            # ended. Read in slices only while a Check of this process's door waits.
            records = RecordsService(recorder, self.ledger, emits=s.source.records_are_events,
                                     checks_waiting=authz_http.waiting if serves_door
                                     else None)
            records.register(self.server)
            self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            with binding(s.listen, "GATEWAY_LISTEN") as (host, port):
                can_bind(host, port)  # a taken port: its reason, before gRPC's bare failure
                self.server.add_insecure_port(s.listen)
            await self.server.start()
        if serves_door:
            with binding(s.authz_http_listen, "GATEWAY_AUTHZ_HTTP_LISTEN") as (host, port):
                self.authz_http = await authz_http.serve(check, host, port, s.max_message_bytes)
        if s.records_http_listen and records is not None:
            with binding(s.records_http_listen, "GATEWAY_RECORDS_HTTP_LISTEN") as (host, port):
                self.records_http = await records_http.serve(records, host, port,
                                                             s.max_message_bytes)
        await self._set_health()
        if serve_http_endpoints:
            with binding(s.metrics_listen, "GATEWAY_METRICS_LISTEN") as (host, port):
                self.http = await serve_http(host, port, {
                    "/metrics": metrics_handler, "/healthz": healthz, "/readyz": self.readyz})
        log.info("serving", role=self.role,
                 listen=s.listen if self.server else None,
                 authz_http=s.authz_http_listen if serves_door else None,
                 records_http=(s.records_http_listen or None) if records is not None else None,
                 metrics=s.metrics_listen, instance=self.instance_id,
                 metering=s.metering,
                 mode="embedded" if s.embedded else "redis",
                 revision=self.holder.policy.revision if self.holder.policy else None)
        if self.holder.policy is None:  # fails closed: say why every request gets a 503
            log.warning("no_policy", detail="every request is refused with 503 until a policy "
                        "is held: `gateway policy apply FILE`, or the hub's revisions through "
                        "`gateway policy sync`")

    def _start_usage_pipeline(self, ledger: Ledger) -> Recorder:
        """The usage pipeline, and the Recorder that writes into its spool."""
        s = self.settings
        usage = self.usage = UsagePipeline.start(s, self.instance_id, self.gate, self.tasks)
        self.tasks.append(watched(self._watch(usage.spools), "watch"))
        recorder = Recorder(usage.spool, s.spoke, ledger, price=self._price)
        # Earlier events than the spools' tails were settled, or their leases ran out long
        # before, and a request id reused since must not be settled by them.
        resettled = usage.resettle(
            2 * s.lease_ttl_s + s.orphan_grace_s,
            lambda lines, since: ledger.settled_before(settlements(lines, since,
                                                                   self._weights)))
        if resettled:
            log.info("spool_tail_resettled", settlements=resettled)
        self.tasks.append(watched(recorder.run_sweeper(s.lease_ttl_s / 3, s.orphan_grace_s),
                                  "orphan_sweeper"))
        return recorder

    def _weights(self, model: str) -> TokenWeights | None:
        """A model's token weights in the policy held now (none held yet: raw tokens)."""
        policy = self.holder.policy
        return policy.token_weights(model) if policy is not None else None

    def _price(self, model: str, at: float) -> Rates | None:
        """A model's price at an instant, from the policy held now (its entries carry their
        dates, so a revision that adds a price does not change what came before it)."""
        policy = self.holder.policy
        return policy.price(model, at) if policy is not None else None

    async def _watch(self, spools: list[Spool]) -> None:
        """Depth and age of what waits for Kafka, whether Redis answers and the gRPC health,
        every second; an error log once a minute while either is degraded, one line when
        it clears."""
        threshold = self.settings.spool_alert_s
        loud = {"spool": 0.0, "store": 0.0}  # when each last logged an error (0: healthy)
        while True:
            now = time.time()
            depth = sum(sp.depth for sp in spools)
            age = max((sp.oldest_age(now) for sp in spools), default=0.0)
            metrics.SPOOL_DEPTH.set(depth)
            metrics.SPOOL_OLDEST_AGE.set(age)
            self.spool_depth, self.spool_oldest_s = depth, age
            _alert(loud, "spool", age > threshold, now, "usage_delivery_stalled",
                   "usage_delivery_recovered", depth=depth, oldest_age_s=round(age, 1),
                   threshold_s=threshold)
            up, why = await self._store_answers()
            if up != self.store_up and self.reporter:
                self.reporter.poke()  # the hub hears of a store going down at once
            self.store_up = up
            metrics.STORE_UP.set(1 if up else 0)
            await self._set_health()  # grpc.health.v1 follows the policy, /readyz polled or not
            _alert(loud, "store", not up, now, "limiter_store_unreachable",
                   "limiter_store_recovered", **({"error": why} if why else {}))
            await asyncio.sleep(1.0)

    def status(self) -> Status:
        """This instance's report to the hub: the revision it serves, whether it took the
        newest it was offered, and what waits in its spool."""
        state, error = self.holder.verdict()
        held = self.holder.policy.revision if self.holder.policy else 0
        return Status(self.settings.spoke, self.instance_id, held, state, error, now_text(),
                      self.spool_depth, round(self.spool_oldest_s, 1), self.store_up)

    async def _store_answers(self) -> tuple[bool, str]:
        """Whether the limiter's store answers a ping within a second, and why not (the
        error that the clients' 503s do not carry)."""
        assert self.limiter is not None
        try:
            async with asyncio.timeout(1.0):
                why = await self.limiter.ping_failure()
        except TimeoutError:
            return False, "no answer to a ping within 1 s"
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return not why, why

    async def _set_health(self) -> None:
        if self.health is None:  # a door process: no gRPC, no gRPC health
            return
        ok = self.holder.policy is not None
        status = health_pb2.HealthCheckResponse.SERVING if ok else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)

    async def readyz(self) -> tuple[int, str, bytes]:
        """Ready = a policy is held, usage can be written and the limiter store answers."""
        await self._set_health()
        if self.holder.policy is None:
            return 503, "text/plain", b"no policy loaded\n"
        if self.gate.closed:
            return 503, "text/plain", (f"usage spool not writable ({self.gate.reason}): new "
                                       "requests are refused\n").encode()
        assert self.limiter is not None
        if not await self.limiter.ping():
            return 503, "text/plain", b"limiter store unreachable\n"
        return 200, "text/plain", f"ready revision={self.holder.policy.revision}\n".encode()

    async def stop(self, grace: float = 2.0) -> None:
        if self.http:
            self.http.close()
        if self.authz_http:
            self.authz_http.close()
        if self.records_http:
            self.records_http.close()
        if self.server:
            await self.server.stop(grace)
        if self.extproc:  # the streams it cut end in their handlers, which may run late
            await self.extproc.drained(STREAMS_DRAIN_S)
        if self.recorder:  # streams the stop cut: their events, before the last commit
            self.recorder.end_waits()
        if self.usage:  # events reach the disk, and queue their settlements, ...
            with contextlib.suppress(OSError):  # (a full disk: logged with what it keeps)
                await self.usage.spool.commit()
        if self.ledger:
            await self.ledger.stop()  # ... which are flushed here
        if self.usage:
            await self.usage.deliver()
        await cancel_all(self.tasks)
        if self.usage:
            await self.usage.close()
        if self.sync:
            await self.sync.stop()
        if self.limiter:
            await self.limiter.close()
        if self.tracing:
            await asyncio.to_thread(self.tracing.shutdown)  # exports what is buffered, ≤ 2 s


def _gate_metric(closed: bool) -> None:
    metrics.SPOOL_WRITABLE.set(0 if closed else 1)


def _alert(loud: dict[str, float], what: str, bad: bool, now: float, bad_event: str,
           cleared_event: str, **facts: object) -> None:
    """Log `bad_event` when `what` turns bad and again every minute it stays so;
    `cleared_event` once."""
    if bad and now - loud[what] >= 60:
        log.error(bad_event, **facts)
        loud[what] = now
    elif not bad and loud[what]:
        log.info(cleared_event, **facts)
        loud[what] = 0.0


async def run(settings: Settings, serve_http_endpoints: bool = True) -> None:
    """Run one instance until SIGTERM/SIGINT."""
    app = App(settings, settings.instance_id)
    await app.start(serve_http_endpoints)
    tune_gc_after_startup()
    await stop_on_signals().wait()
    log.info("stopping", instance=app.instance_id)
    with contextlib.suppress(Exception):
        await app.stop()
