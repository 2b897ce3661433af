"""Prometheus metrics of one instance (or, with several workers, of all of them, merged).

A leaf: it imports nothing of the gateway, so any layer may count without depending on the
servers. What a metric means is decided by the code that increments it.
"""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter(
    "gateway_authz_decisions_total", "ext_authz decisions", ["outcome", "reason", "tier"])
CHECK_SECONDS = Histogram(
    "gateway_authz_check_seconds", "Check latency inside the sidecar",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5))
POLICY_REVISION = Gauge(
    "gateway_policy_revision", "Policy revision held", multiprocess_mode="livemax")
POLICY_LOADS = Counter("gateway_policy_loads_total", "Policy load attempts", ["result"])
STREAMS_ACTIVE = Gauge(
    "gateway_extproc_streams_active", "ext_proc streams open", multiprocess_mode="livesum")
SETTLE_ERRORS = Counter("gateway_settle_errors_total", "Settlements the store refused")
READY = Gauge("gateway_ready", "1 when this worker has a policy", multiprocess_mode="livemin")
SINK_ERRORS = Counter("gateway_usage_sink_errors_total", "Failed deliveries to Kafka/JSONL")
SPOOL_WRITE_ERRORS = Counter("gateway_usage_spool_write_errors_total",
                             "Group commits or delivered marks the spool could not write "
                             "(kept in memory, retried)")
SPOOL_READ_ERRORS = Counter("gateway_usage_spool_read_errors_total",
                            "Reads of spooled events that failed (retried)")
SPOOL_UNREADABLE = Counter("gateway_usage_spool_unreadable_total",
                           "Spooled lines that are not an event (sent on as they are)")
EVENTS_DELIVERED = Counter("gateway_usage_events_delivered_total", "Events the sink acknowledged")
EVENTS = Counter("gateway_usage_events_total", "Usage events emitted", ["outcome"])
DENIALS_DROPPED = Counter(
    "gateway_usage_denials_dropped_total",
    "Denied requests' events not kept: the spool could not write and already held "
    "DENIED_HELD_MAX events in memory (they bill nothing; the billed ones are kept)")
SPOOL_WRITABLE = Gauge(
    "gateway_usage_spool_writable",
    "0 while the spool's group commits fail (disk full, read-only, EIO): new requests are "
    "refused with 503 until one succeeds; else 1", multiprocess_mode="livemin")
SPOOL_DEPTH = Gauge("gateway_usage_spool_depth", "Events not yet delivered",
                    multiprocess_mode="livesum")
TOKENS = Counter("gateway_tokens_total", "Tokens metered", ["model", "team", "kind"])
TTFT = Histogram("gateway_ttft_seconds", "Time to first token", ["model"],
                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
TPOT = Histogram("gateway_tpot_seconds", "Mean time per output token", ["model"],
                 buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1))
EXTPROC_MESSAGES = Counter("gateway_extproc_messages_total", "ext_proc messages", ["kind"])
RECORDS = Counter("gateway_envoy_records_total", "Per-request records received from Envoy")
RECORD_DUPLICATES = Counter(
    "gateway_envoy_record_duplicates_total", "Records Envoy sent again (a retried batch)")
RECORD_HEARTBEATS = Counter(
    "gateway_envoy_record_heartbeats_total", "Periodic records of requests still in flight")
RECORDS_ANSWERED_UNSETTLED = Counter(
    "gateway_envoy_record_batches_answered_unsettled_total",
    "Batches answered before their settlements reached the limiter store (it was down)")
RECORDS_UNREADABLE = Counter(
    "gateway_envoy_records_unreadable_total",
    "Records whose facts could not be read (their requests are billed as orphans)")
ADMISSIONS_UNHEARD = Counter(
    "gateway_admissions_unheard_total",
    "Envoy-fed admissions given up: no record or heartbeat within GATEWAY_LEASE_TTL_S "
    "(Envoy died, or lost the record); the orphan sweep frees and bills them")
ADMISSIONS_OPEN = Gauge(
    "gateway_admissions_open", "Admissions this instance is renewing (requests in flight)",
    multiprocess_mode="livesum")
ADMISSIONS_EXPIRED = Counter(
    "gateway_admissions_expired_total",
    "Admissions given up at GATEWAY_ADMISSION_MAX_LIFETIME_S (no longer renewed); the orphan "
    "sweep frees and bills them unless their end comes first")
LEDGER_REFUSED = Counter(
    "gateway_ledger_refused_total",
    "Admission transitions refused as no-ops: no request id, or a stage they cannot come from",
    ["transition", "stage"])
TICKETS = Counter(
    "gateway_admission_tickets_total",
    "Admissions made ahead (GATEWAY_ADMIT_AHEAD_MS): taken by a request, expired unused, "
    "refused by Redis (no headroom), or unbound (taken, then not renamed to the request)",
    ["result"])
ORPHANS = Counter("gateway_orphans_total", "Admissions the orphan sweep freed and billed")
ORPHAN_RECORDS_LOST = Counter(
    "gateway_orphan_records_lost_total",
    "Admissions the orphan sweep found with their record expired: no usage event was made")
SPOOL_OLDEST_AGE = Gauge(
    "gateway_usage_spool_oldest_age_seconds",
    "How long the oldest undelivered usage event has waited (Kafka down or slow)",
    multiprocess_mode="livemax")
STORE_UP = Gauge("gateway_limiter_store_up",
                 "1 while the limiter store (Redis) answers, else 0 (admissions fail closed)",
                 multiprocess_mode="livemin")

# A sidecar's state: another process (`policy sync`) does not show them, since their zeros
# there would read as a sidecar down (`gateway_ready 0`, `gateway_limiter_store_up 0`).
SIDECAR_GAUGES = frozenset((
    "gateway_policy_revision", "gateway_extproc_streams_active", "gateway_ready",
    "gateway_usage_spool_depth", "gateway_admissions_open",
    "gateway_usage_spool_oldest_age_seconds", "gateway_limiter_store_up",
    "gateway_usage_spool_writable"))

# Hub and spokes (DESIGN §10)
STATUS_SEND_ERRORS = Counter(
    "gateway_hub_status_send_errors_total", "Status reports the hub's Kafka did not take")
SYNC_REVISIONS = Counter(
    "gateway_hub_sync_revisions_total",
    "Feed revisions by what the syncer did: applied, refused (NACK), restored (from disk)",
    ["result"])
SYNC_ERRORS = Counter(
    "gateway_hub_sync_errors_total",
    "Sync rounds that failed: Redis or Kafka away, Redis moved meanwhile (conflict), or "
    "anything else (failed: logged as hub_sync_round_failed)",
    ["what"])


@functools.cache
def sync_gauges() -> tuple[Gauge, Gauge, Gauge]:
    """The syncer's gauges (feed up, the feed's revision, Redis's), created by the syncer
    on first use: a gauge exists from its creation, so `gateway serve`'s /metrics would
    otherwise show a feed that is down (`gateway_hub_feed_up 0`) in a process with none."""
    return (
        Gauge("gateway_hub_feed_up", "1 while the policy feed (the hub's Kafka) answers the "
              "syncer"),
        Gauge("gateway_hub_feed_revision", "The revision the feed holds for this spoke "
              "(0: none)"),
        Gauge("gateway_hub_sync_held_revision", "The revision the spoke's Redis holds, as "
              "last seen"))


@functools.cache
def quota_gauges() -> tuple[Gauge, Gauge, Gauge, Gauge]:
    """The allowance follower's gauges (a task of `policy sync`), created on first use as
    `sync_gauges` are: Kafka up for `llm.quota.v1`, the spoke's Redis up, the newest
    generation applied and when (unix time; 0: none yet)."""
    return (
        Gauge("gateway_quota_feed_up", "1 while the hub's Kafka answers the allowance "
              "follower (llm.quota.v1)"),
        Gauge("gateway_quota_store_up", "0 while the spoke's Redis does not answer the "
              "allowance follower (probed every 2 s)"),
        Gauge("gateway_quota_allowance_generation", "The newest allowance generation the "
              "follower applied (0: none yet)"),
        Gauge("gateway_quota_allowance_applied_timestamp_seconds", "When the follower last "
              "applied an allowance generation (unix time; 0: none yet)"))


_CHILDREN: dict[tuple[Any, ...], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once per label set: `labels()` costs ~3 µs a call
    (a lock, a label check), and the records path makes four or five an event. Only what is
    counted is made (a child shows in /metrics from then on, as with `labels()`)."""
    key = (metric, *labels)
    found = _CHILDREN.get(key)
    if found is None:
        found = _CHILDREN[key] = metric.labels(*labels)
    return found
