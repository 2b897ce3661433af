"""What must hold after any fault: every admitted request has exactly one usage event, no
slot is leaked, nothing reached the engine unmetered, token counters equal billed tokens."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx
import orjson

from devspoke.stack import Spoke
from devspoke.usage_topic import USAGE_TOPIC
from gateway.hub.topics import read_all
from gateway.limits import maths
from gateway.redis_clients import sync_client
from testkit.load import Result


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"not reached within {timeout:.0f}s: {what}")


def spool_depth(spoke: Spoke) -> float:
    try:
        text = httpx.get(f"{spoke.metrics_url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return -1
    for line in text.splitlines():
        if line.startswith("gateway_usage_spool_depth"):
            return float(line.split()[-1])
    return -1


def _read_to_end(spoke: Spoke) -> list[dict[str, Any]]:
    return [orjson.loads(v) for _, v in
            asyncio.run(read_all(spoke.kafka_bootstrap, USAGE_TOPIC, timeout=15)) if v]


def _topic_once_drained(spoke: Spoke, admitted: set[str]) -> list[dict[str, Any]]:
    """Every event on the usage topic, read to its end once every admitted request's event
    is there (or 8 s have passed), then once more 1.5 s later: the spool gauge the caller
    waited on may be up to a second old, so an orphan's or a late duplicate's event written
    just before it read 0 is still counted. (A fixed 8 s read was half of most fault tests.)"""
    deadline = time.monotonic() + 8
    while not admitted <= {e["event_id"] for e in _read_to_end(spoke)}:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    time.sleep(1.5)
    return _read_to_end(spoke)


def check(spoke: Spoke, results: list[Result], key_id: str, *, lease_ttl: float,
          engine_before: int = 0, token_check: bool = True,
          replication_loss: bool = False) -> dict[str, Any]:
    """`replication_loss`: Redis failed over, so writes its old primary never passed on may
    be gone (docs/operations.md "Redis under Sentinel"): the token counter may then be short of the
    billed total, never above it (nothing counted twice)."""
    r = sync_client(spoke.redis_url)
    _wait(lambda: httpx.get(f"{spoke.engine_url}/mock/stats").json()["in_flight"] == 0,
          30, "the engine has nothing in flight")
    # Leases come back: released at the end, or swept after the lease TTL (dead sidecar).
    _wait(lambda: sum(r.zcount(k, time.time() * 1000, "+inf")
                      for k in r.scan_iter("gw:conc:*")) == 0,
          lease_ttl * 2 + 10, "no live concurrency lease")
    _wait(lambda: r.zcard("gw:reqs") == 0, lease_ttl * 2 + 10, "every admission settled")
    _wait(lambda: spool_depth(spoke) == 0, 60, "the spool drained")
    admitted = {x.request_id for x in results if x.status == 200}
    events = _topic_once_drained(spoke, admitted)
    ids = Counter(e["event_id"] for e in events)
    distinct = {e["event_id"]: e for e in events}
    missing = admitted - set(distinct)
    assert not missing, f"{len(missing)} admitted requests have no usage event"
    mine = [e for e in distinct.values() if e["key_id"] == key_id]
    # Nothing reached the engine without an event (orphans may add events that did not).
    engine = httpx.get(f"{spoke.engine_url}/mock/stats").json()["requests"] - engine_before
    served = [e for e in mine if e["outcome"] != "denied"]
    assert engine <= len(served), f"engine saw {engine}, only {len(served)} events"
    # Token counters equal the events' totals (reservations all replaced by actuals).
    day = maths.day_id(time.time())
    counter = int(r.get(f"gw:tpd:key:{key_id}:{day}") or 0)
    billed = sum(int(e["usage"]["total_tokens"]) for e in served)
    if token_check and replication_loss:
        assert counter <= billed, f"token counter {counter} > billed {billed}: counted twice"
    elif token_check:
        assert counter == billed, f"token counter {counter} != billed {billed}"
    # seq per instance: gap-free, from 1, over every event on the topic. A request may have
    # two events with two seqs (at-least-once: a record made durable just before a SIGKILL,
    # whose ack died with the process, is sent again by Envoy and recorded again after the
    # restart); consumers dedup those on event_id, so both seqs are on the topic.
    by_instance: dict[str, set[int]] = {}
    for e in events:
        by_instance.setdefault(e["instance_id"], set()).add(int(e["seq"]))
    for inst, seqs in by_instance.items():
        assert sorted(seqs) == list(range(1, len(seqs) + 1)), f"seq gap in {inst}"
    return {"requests": len(results), "admitted": len(admitted), "events": len(distinct),
            "duplicates": sum(ids.values()) - len(ids), "engine": engine,
            "billed_tokens": billed, "token_counter": counter,
            "outcomes": Counter(e["outcome"] for e in mine),
            "orphans": _orphans(spoke)}


def _orphans(spoke: Spoke) -> int:
    """Requests the sweep billed as orphans (their sidecar died and no end ever came)."""
    return sum(open(p).read().count('"orphaned_request"')
               for p in spoke.workdir.glob("sidecar-*.log"))
