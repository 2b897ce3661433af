"""A whole local spoke: Redis, the mock engine, the sidecar and Envoy, each a real process.

`gateway dev` runs one for people; the end-to-end tests run one per session and kill its
parts to prove the failure modes; the benchmarks measure through one. Every port is
free-picked except Envoy's when asked.
"""

from __future__ import annotations

import contextlib
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devspoke.envoy_proc import EnvoyService, envoy_service
from devspoke.procs import Service, free_port, redis_service, reserve, tansu_service
from devspoke.publish import publish
from devspoke.sentinels import sentinel_set, sentinel_url
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from gateway.metering.sources import source_named
from gateway.settings import DEFAULT_METERING, Metering

LOOP = "127.0.0.1"


def sidecar_service(port: int, metrics_port: int, workdir: Path, env: dict[str, str]) -> Service:
    argv = [sys.executable, "-m", "gateway", "serve"]
    full_env = {
        "GATEWAY_LISTEN": f"{LOOP}:{port}",
        "GATEWAY_METRICS_LISTEN": f"{LOOP}:{metrics_port}",
        "GATEWAY_AUTHZ_HTTP_LISTEN": "",  # the door on a fixed port: only when `env` asks
        **env,
    }
    return Service("sidecar", argv, port, workdir, env=full_env)


def metric(metrics_url: str, name: str) -> float | None:
    """One unlabelled value of a process's /metrics at `metrics_url` (http://host:port);
    None if it is not there or the page cannot be read."""
    try:
        with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=1) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def wait_ready(metrics_url: str, timeout: float = 30.0) -> None:
    """Block until the sidecar's /readyz answers 200: it is up and has a policy. A sidecar
    accepts Checks before that, and answers them 503."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{metrics_url}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"{exc.code} {exc.read().decode(errors='replace').strip()}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.05)
    raise TimeoutError(f"sidecar at {metrics_url} never became ready: {last}")


def engine_service(port: int, workdir: Path, ttft_ms: float = 20, tokens_per_s: float = 500,
                   ) -> Service:
    argv = [sys.executable, "-m", "devspoke.mock_engine", "--host", LOOP, "--port", str(port),
            "--ttft-ms", str(ttft_ms), "--tokens-per-s", str(tokens_per_s)]
    return Service("engine", argv, port, workdir)


SPOKE_ID = "dev"  # the sidecar's GATEWAY_SPOKE unless sidecar_env names another


@dataclass
class Spoke:
    workdir: Path
    listen_port: int
    sidecar_env: dict[str, str] = field(default_factory=dict)
    engine_ttft_ms: float = 20
    engine_tokens_per_s: float = 500
    kafka: bool = True
    kafka_bootstrap_shared: str | None = None  # a broker other spokes share (none started)
    otlp: str | None = None  # an OTLP/gRPC collector: Envoy and the sidecar send it traces
    services: dict[str, Service] = field(default_factory=dict)
    metrics_port: int = 0
    engine: Callable[[int, Path], Service] | None = None  # another engine (port, workdir)
    metering: Metering = DEFAULT_METERING  # who does the per-chunk work: Envoy or ext_proc
    # Envoy's bootstrap YAML for these ports (default: this code's render); a benchmark's
    # baseline spoke renders it with an older revision's code
    envoy_config: Callable[[EnvoyPorts, Metering], str] | None = None
    # ext_authz through the sidecar's HTTP door (default: with Envoy-fed metering, the
    # cheaper pair; ext_proc's spoke keeps the portable gRPC Check)
    authz_http: bool | None = None
    authz_http_address: str | None = None  # the door's, once started with it
    # Envoy's records over OTLP/HTTP to the sidecar (default: over gRPC, which Envoy retries)
    records_http: bool = False
    # Envoy-fed metering's heartbeat (Envoy's config and the sidecar's setting, together)
    record_heartbeat_s: float | None = None
    keep_request_ids: bool = False  # Envoy keeps a client's own x-request-id
    # how often Envoy sends its records (None: gateway/envoyconf/metering.py's FLUSH)
    records_flush_s: float | None = None
    envoy_workers: int = 1  # Envoy's --concurrency (its default would be one per core)
    # Redis as production runs it: a primary ("redis"), a replica ("redis-replica") and three
    # Sentinels ("sentinel-N"); the sidecar gets the redis+sentinel:// URL
    sentinel: bool = False

    @property
    def spoke_id(self) -> str:
        """The sidecar's GATEWAY_SPOKE."""
        return self.sidecar_env.get("GATEWAY_SPOKE", SPOKE_ID)

    def start(self) -> Spoke:
        self.workdir.mkdir(parents=True, exist_ok=True)
        reserve(self.listen_port)  # Envoy binds it last
        self.metrics_port = free_port()
        pre: dict[str, Service] = (sentinel_set(self.workdir) if self.sentinel
                                   else {"redis": redis_service(free_port(), self.workdir)})
        engine = (engine_service(free_port(), self.workdir, self.engine_ttft_ms,
                                 self.engine_tokens_per_s)
                  if self.engine is None else self.engine(free_port(), self.workdir))
        env = {"GATEWAY_REDIS_URL": self._redis_url(pre), "GATEWAY_SPOKE": SPOKE_ID,
               "GATEWAY_POLICY_RECHECK_S": "2", "GATEWAY_SPOOL_DIR": str(self.workdir / "spool"),
               "GATEWAY_USAGE_JSONL": str(self.workdir / "usage.jsonl"),
               "GATEWAY_METERING": self.metering}
        if self.kafka_bootstrap_shared:
            env["GATEWAY_KAFKA_BOOTSTRAP"] = self.kafka_bootstrap_shared
            env["GATEWAY_KAFKA_IDEMPOTENCE"] = "false"
        elif self.kafka:
            pre["kafka"] = tansu_service(free_port(), self.workdir)
            env["GATEWAY_KAFKA_BOOTSTRAP"] = pre["kafka"].address
            env["GATEWAY_KAFKA_IDEMPOTENCE"] = "false"  # Tansu: see docs/kafka-broker.md
        if self.otlp:
            env |= {"OTEL_TRACES_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{self.otlp}"}
        door = None
        if (self.authz_http if self.authz_http is not None
                else not source_named(self.metering).portable):
            door = env["GATEWAY_AUTHZ_HTTP_LISTEN"] = f"{LOOP}:{free_port()}"
        self.authz_http_address = door
        records = None
        if self.records_http:
            records = env["GATEWAY_RECORDS_HTTP_LISTEN"] = f"{LOOP}:{free_port()}"
        extra: dict[str, Any] = {"keep_request_ids": self.keep_request_ids}
        if self.record_heartbeat_s is not None:
            env["GATEWAY_RECORD_HEARTBEAT_S"] = str(self.record_heartbeat_s)
            extra["heartbeat_s"] = self.record_heartbeat_s
        if self.records_flush_s is not None:
            extra["records_flush_s"] = self.records_flush_s
        env.update(self.sidecar_env)
        sidecar = sidecar_service(free_port(), self.metrics_port, self.workdir, env)
        ports = EnvoyPorts(listen=f"{LOOP}:{self.listen_port}", sidecar=sidecar.address,
                           engine=engine.address, admin=f"{LOOP}:{free_port()}", otlp=self.otlp,
                           authz_http=door, records_http=records)
        config = (render(ports, metering=self.metering, **extra) if self.envoy_config is None
                  else self.envoy_config(ports, self.metering))
        envoy = envoy_service(config, int(ports.admin.rsplit(":", 1)[1]), self.listen_port,
                              self.workdir, concurrency=self.envoy_workers)
        self.services = {**pre, "engine": engine, "sidecar": sidecar, "envoy": envoy}
        try:
            for svc in self.services.values():
                svc.start()
        except Exception:
            self.stop()
            raise
        return self

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop every service. With `drain_s` (gateway dev): the requests in flight get up
        to that long to finish; the engine's stop then cuts the rest, so Envoy ends them
        itself and sends their records; the sidecar is stopped only once it has every
        record and delivered every event (each bounded by a few seconds)."""
        envoy = self.services.get("envoy")
        if drain_s and isinstance(envoy, EnvoyService) and envoy.alive:
            with contextlib.suppress(OSError):
                self._drain(envoy, drain_s)
        for svc in reversed(list(self.services.values())):
            svc.stop()

    def _drain(self, envoy: EnvoyService, bound: float) -> None:
        if envoy.wait_idle(bound):
            with contextlib.suppress(OSError):  # nobody may read our output any more
                print(f"  cutting the streams still running after {bound:g}s", flush=True)
            self.services["engine"].stop()
            envoy.wait_idle(5.0)
        # Envoy's records of the last requests (50 ms buffers), then their events' delivery.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            held = self.metric("gateway_admissions_open"), self.metric(
                "gateway_usage_spool_depth")
            if held == (0.0, 0.0):
                return
            time.sleep(0.1)

    def metric(self, name: str) -> float | None:
        """One unlabelled value of the sidecar's /metrics (None: not there)."""
        return metric(self.metrics_url, name)

    def publish(self, doc: dict[str, Any], source: str, *, prune: bool = False) -> int:
        """Publish a policy (devspoke.publish) to this spoke's Redis; its revision."""
        return publish(self.redis_url, doc, source, prune=prune)

    def wait_ready(self, timeout: float = 30.0) -> None:
        wait_ready(self.metrics_url, timeout)

    @property
    def redis_url(self) -> str:
        """What the sidecar is given: the primary's, or the Sentinels' URL."""
        return self._redis_url(self.services)

    def _redis_url(self, services: dict[str, Service]) -> str:
        if self.sentinel:
            return sentinel_url(services)
        return f"redis://{services['redis'].address}/0"

    @property
    def kafka_bootstrap(self) -> str:
        return self.kafka_bootstrap_shared or self.services["kafka"].address

    @property
    def base_url(self) -> str:
        return f"http://{LOOP}:{self.listen_port}/v1"

    @property
    def engine_url(self) -> str:
        return f"http://{self.services['engine'].address}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOP}:{self.metrics_port}"

    def __getitem__(self, name: str) -> Service:
        return self.services[name]
