"""Settings from env (GATEWAY_*) or flags (DESIGN §7)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.metering.sources import MeteringSource, source_named
from gateway.sentinel_url import check_redis_url

# Who does the per-chunk work of metering (docs/request-flow.md "Two metering sources"): the
# names of gateway/metering/sources.py's sources, which say what each one means (a test keeps
# them equal).
Metering = Literal["envoy", "ext_proc"]
METERING_SOURCES: tuple[Metering, ...] = ("envoy", "ext_proc")
DEFAULT_METERING: Metering = "envoy"  # the cheaper one, with every guarantee (README)

# The reference addresses (DESIGN §7): `gateway serve`'s defaults, which `envoy/envoy.yaml`
# (`gateway envoy-config`'s default) reaches. The Check goes through the HTTP door.
REFERENCE_LISTEN = "127.0.0.1:9001"
REFERENCE_AUTHZ_HTTP = "127.0.0.1:9002"


_KAFKA_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")

_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+)(?::([0-9]{1,5}))?")


def _bootstrap_server(text: str) -> bool:
    """One Kafka bootstrap server: a host name or IP ('[v6]'), with a port or without."""
    m = _HOST_PORT.fullmatch(text)
    return m is not None and (m[2] is None or 0 < int(m[2]) < 65536)


# GATEWAY_LOG_LEVEL's names, in any case (gateway/log.py maps them to logging's levels)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# A duration or a size that must be more than nothing (0 would spin a loop or refuse all).
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Count = Annotated[int, Field(ge=0)]


class Settings(BaseSettings):
    # hide_input_in_errors: a refused URL may carry a password
    # allow_inf_nan: no setting is a NaN or an infinity (a NaN lease TTL was taken as is)
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore",
                                      hide_input_in_errors=True, allow_inf_nan=False)

    listen: str = REFERENCE_LISTEN
    # ext_authz's HTTP door, the reference config's Check (`gateway envoy-config`): the same
    # Check without gRPC's cost per call. Empty: not served (a gRPC-Check-only Envoy).
    authz_http_listen: str = REFERENCE_AUTHZ_HTTP
    # Envoy's per-request records over OTLP/HTTP (`gateway envoy-config --records-http`):
    # cheaper than their gRPC, but Envoy never retries them (docs/envoy.md §6). Empty: not
    # served (the reference config sends them over gRPC to `listen`).
    records_http_listen: str = ""
    metrics_listen: str = "127.0.0.1:9102"
    redis_url: str | None = None  # unset → embedded mode (policy file, in-process counters)
    policy_file: Path | None = None
    kafka_bootstrap: str | None = None  # unset → JSONL file sink
    usage_topic: str = "llm.usage.v1"
    spool_dir: Path = Path(".gateway-spool")
    spoke: str = "local"
    instance_id: str = ""  # default: the spool this host left behind, else hostname-pid
    workers: Annotated[int, Field(ge=1)] = 1
    # Processes that serve only the HTTP door (GATEWAY_AUTHZ_HTTP_LISTEN, SO_REUSEPORT), so a
    # Check never waits behind a batch of Envoy's records on the records' event loop
    # (docs/operations.md, "Door workers"). 0: the door is served with everything else.
    door_workers: Count = 0
    kafka_idempotence: bool = True  # off against Tansu (docs/kafka-broker.md)
    usage_jsonl: Path = Path("usage.jsonl")  # embedded mode's sink
    # Models served by vLLM/SGLang: also ask for continuous usage, so a cut stream is exact.
    continuous_usage_models: str = ""  # comma-separated globs, e.g. "*" or "qwen*,llama*"
    log_level: str = "info"
    # Who does the per-chunk work: Envoy's own filters, one record per request to the
    # sidecar ('envoy'), or the sidecar through ext_proc ('ext_proc'). Must match the Envoy
    # config (`gateway envoy-config --metering`).
    metering: Metering = DEFAULT_METERING
    # A concurrency denial waits up to this for ends on their way, then retries (default:
    # 100 ms with Envoy-fed metering, whose records arrive ~50 ms after the end; else 0).
    concurrency_grace_ms: NonNegative | None = None
    # Admitting ahead (docs/admit-ahead.md): how long a ticket admitted for the next request
    # of a key and model is kept. 0: off, every admission waits for Redis. Redis mode only.
    admit_ahead_ms: NonNegative = 0.0

    # Admission
    redis_deadline_ms: Positive = 250.0  # < Envoy's ext_authz timeout (500 ms in envoy/envoy.yaml)
    lease_ttl_s: Positive = 30.0  # concurrency leases; streams renew at a third of it
    # Envoy-fed metering: Envoy's heartbeat record of a request in flight comes this often
    # (`gateway envoy-config --record-heartbeat-s`: the two must agree). An admission Envoy
    # says nothing of for three heartbeats is given up: freed and billed by the orphan sweep.
    record_heartbeat_s: Positive = 10.0
    orphan_grace_ms: NonNegative | None = None  # default: 45 s with Envoy-fed metering, else 0
    # An admission's first lease: its ext_proc stream must begin (and renew it) within this,
    # else the slot frees itself (the client left between the Check and ext_proc).
    lease_start_ttl_s: Positive = 5.0
    # No admission is renewed for longer than this (6 h: far past any real generation):
    # one whose stream or heartbeats never stop is then given up, its lease runs out, and
    # the orphan sweep frees its slots and bills its last checkpoint.
    admission_max_lifetime_s: Positive = 21600.0
    default_completion_tokens: Count = 1024
    # caps the completion side of a reservation (max_tokens times the sequences asked for:
    # n, best_of, list prompts), all sequences together; the prompt counts whole
    reserve_cap_tokens: Count = 32768
    # Degraded states are loud: an error log (once a minute) when the oldest undelivered
    # usage event is older than this, or the limiter store stops answering.
    spool_alert_s: Positive = 60.0
    policy_recheck_s: Positive = 5.0  # periodic re-check so a missed announcement heals
    # gRPC: a CheckRequest carries the whole body
    max_message_bytes: Annotated[int, Field(gt=0)] = 64 * 1024 * 1024

    # Hub and spokes (DESIGN §10): the hub's Kafka, when not the usage Kafka's
    hub_bootstrap: str | None = None
    # The replication factor of the hub's topics (llm.policy.v1, llm.gateway.status.v1,
    # llm.quota.v1) when their first writer creates them; a topic already there is never
    # changed. 1 suits one broker (Tansu, a dev Kafka); a production Kafka wants its
    # brokers' usual (3), so the policy feed outlives a broker.
    topic_replication: int = 1
    status_interval_s: Positive = 10.0  # heartbeat on llm.gateway.status.v1
    # `policy sync`: the last good revision on disk (a wiped Redis comes back serving it)
    sync_state_dir: Path = Path(".gateway-sync")
    sync_metrics_listen: str = "127.0.0.1:9103"  # `policy sync`'s /metrics, /healthz

    @field_validator("spoke", "instance_id")
    @classmethod
    def _status_key_part(cls, v: str) -> str:
        # The status topic's key is SPOKE/INSTANCE (DESIGN §10): a '/' in either would make
        # it ambiguous.
        if "/" in v:
            raise ValueError("must not contain '/' (the status key is SPOKE/INSTANCE)")
        return v

    @field_validator("spoke")
    @classmethod
    def _spoke(cls, v: str) -> str:
        # A blank spoke, or '*' (every spoke's feed key), would follow no entry of its own.
        if not v.strip() or v == "*":
            raise ValueError("must name this spoke ('*' is every spoke's feed entry)")
        return v

    @field_validator("topic_replication")
    @classmethod
    def _topic_replication(cls, v: int) -> int:
        # aiokafka's NewTopic refuses -1 (the broker's default.replication.factor)
        if v < 1:
            raise ValueError(f"must be 1 or more (the number of brokers each hub topic is "
                             f"kept on; -1, the broker's default, cannot be asked), not {v}")
        return v

    @field_validator("policy_file", mode="before")
    @classmethod
    def _policy_file(cls, v: object) -> object:
        # set but empty (`GATEWAY_POLICY_FILE=`) is unset, as for the URLs: not the path '.'
        return None if v == "" else v

    @field_validator("spool_dir", "usage_jsonl", "sync_state_dir", mode="before")
    @classmethod
    def _a_path(cls, v: object) -> object:
        # '' would be '.': the working directory as the spool, or as the JSONL sink (a
        # directory: every delivery failing for ever)
        if v == "":
            raise ValueError("must name a path, not be empty")
        return v

    @field_validator("kafka_bootstrap", "hub_bootstrap")
    @classmethod
    def _bootstrap(cls, v: str | None) -> str | None:
        # aiokafka reads these only when it first connects: a bad port crashed the status
        # reporter, and every delivery would fail for ever (empty: unset)
        if v and not all(_bootstrap_server(part.strip()) for part in v.split(",")):
            raise ValueError("must be HOST[:PORT] or a comma-separated list of them "
                             "(PORT 1 to 65535, default 9092)")
        return v

    @field_validator("usage_topic")
    @classmethod
    def _usage_topic(cls, v: str) -> str:
        # one Kafka would refuse: every delivery of every event failing for ever
        if not _KAFKA_TOPIC.fullmatch(v) or v in (".", ".."):  # Kafka refuses those two
            raise ValueError(f"must be a Kafka topic name (1 to 249 of a-z, A-Z, 0-9, '.', "
                             f"'_', '-'; not '.' or '..'), not {v!r}")
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        # gateway/log.py took a name it does not know as info: a misspelt "debg" said nothing
        if v.lower() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, not {v!r}")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        return check_redis_url(v) if v else v

    @classmethod
    def from_args(cls, args: object) -> Settings:
        """Env settings, overridden by the command-line flags that were given."""
        overrides = {k: v for k, v in vars(args).items()
                     if k in cls.model_fields and v is not None}
        return cls(**overrides)

    @property
    def continuous_models(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.continuous_usage_models.split(",") if p.strip())

    @property
    def source(self) -> MeteringSource:
        """What GATEWAY_METERING's source asks of the sidecar (gateway/metering/sources.py)."""
        return source_named(self.metering)

    @property
    def concurrency_grace_s(self) -> float:
        if self.concurrency_grace_ms is not None:
            return self.concurrency_grace_ms / 1000
        return self.source.concurrency_grace_s

    @property
    def orphan_grace_s(self) -> float:
        """How long past its lease an unsettled admission waits before the sweep bills it as
        an orphan: with Envoy-fed metering its record may still come (Envoy retries a batch
        for ~36 s), and it carries the real usage where the orphan's event has none."""
        if self.orphan_grace_ms is not None:
            return self.orphan_grace_ms / 1000
        return self.source.orphan_grace_s

    @property
    def unheard_s(self) -> float:
        """How long an Envoy-fed admission is renewed without a word of it from Envoy."""
        return 3 * self.record_heartbeat_s

    @property
    def feed_bootstrap(self) -> str | None:
        """The Kafka the hub's topics live on: GATEWAY_HUB_BOOTSTRAP, else the usage Kafka."""
        return self.hub_bootstrap or self.kafka_bootstrap

    @property
    def embedded(self) -> bool:
        return not self.redis_url


def cli_settings(args: object) -> Settings:
    """A command's settings (env, then its flags); a bad one exits (status 1) with one line
    naming each by its env name (a flag's setting has the same name) and what is wrong."""
    from pydantic import ValidationError
    try:
        return Settings.from_args(args)
    except ValidationError as exc:
        raise SystemExit("gateway: bad settings: " + "; ".join(
            f"GATEWAY_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}"
            for e in exc.errors())) from None
