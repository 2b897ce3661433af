"""Envoy-fed metering when a request's record never comes: Envoy killed mid-stream, the
records' way to the sidecar cut for longer than Envoy retries, a record the sidecar cannot
read. Every admitted request still gets exactly one event, and its slot and reservation are
freed within the stated bound (docs/request-flow.md "Every admission ends"):

    unheard (3 heartbeats) + lease TTL + sweep interval (lease TTL / 3) + orphan grace
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from probes import until
from proxy import SlowProxy

from devspoke.stack import Spoke
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from gateway.settings import Metering
from testkit.invariants import check
from testkit.load import Result
from testkit.spoke import read_events, start_spoke

HEARTBEAT, LEASE_TTL, GRACE = 1.0, 3.0, 0.5
BOUND = 3 * HEARTBEAT + LEASE_TTL + LEASE_TTL / 3 + GRACE  # 7.5 s here; 115 s by default
SIDECAR_ENV = {"GATEWAY_LEASE_TTL_S": str(LEASE_TTL),
               "GATEWAY_ORPHAN_GRACE_MS": str(GRACE * 1000)}


def spoke_with(tmp: Path, envoy_config: Callable[[EnvoyPorts, Metering], str] | None = None,
               ) -> tuple[Spoke, dict[str, str]]:
    return start_spoke(tmp / "spoke", metering="envoy", record_heartbeat_s=HEARTBEAT,
                       sidecar_env=dict(SIDECAR_ENV), envoy_config=envoy_config)


@pytest.fixture
def envoy_spoke(tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = spoke_with(tmp_path)
    yield spoke, keys
    spoke.stop()


class Streams:
    """Long streams in threads; each one's request id once its headers arrived."""

    def __init__(self, spoke: Spoke, key: str, n: int, tokens: int, per_s: int = 50) -> None:
        self.results: list[Result] = []
        self._started = threading.Semaphore(0)
        body = {"model": "mock-model", "max_tokens": tokens, "stream": True,
                "messages": [{"role": "user", "content": "a long story"}]}
        headers = {"authorization": f"Bearer {key}", "x-mock-tokens-per-s": str(per_s)}
        self._threads = [threading.Thread(target=self._one, args=(spoke, body, headers),
                                          daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()
        for _ in range(n):
            assert self._started.acquire(timeout=10), "a stream never started"

    def _one(self, spoke: Spoke, body: dict[str, Any], headers: dict[str, str]) -> None:
        r = Result("stream", 0)
        try:
            with httpx.stream("POST", f"{spoke.base_url}/chat/completions", json=body,
                              headers=headers, timeout=60) as resp:
                r.status, r.request_id = resp.status_code, resp.headers["x-request-id"]
                self.results.append(r)
                self._started.release()
                for _ in resp.iter_raw():
                    pass
                r.completed = True
        except httpx.HTTPError as exc:
            r.error = type(exc).__name__
            if not r.status:
                self.results.append(r)
                self._started.release()

    def join(self) -> list[Result]:
        for t in self._threads:
            t.join(60)
        return self.results


def settled_within(spoke: Spoke, results: list[Result], bound: float) -> list[dict[str, Any]]:
    """Every admitted request's one event arrives, and its slot is free, within `bound`.

    The time taken counts the reader's own work too (a consumer's start, the whole topic,
    `settle`): beside seven workers that alone can take seconds. So it is measured again
    in this run, on the same events once there, and taken off: what is left is the sweep
    and the shipping, still held to the bound plus 5 s (a regressed bound, e.g. a longer
    unheard or sweep interval, still fails; a quiet machine's reading costs ~1 s)."""
    ids = {r.request_id for r in results if r.status == 200}
    t0 = time.monotonic()
    events = read_events(spoke.kafka_bootstrap, ids, timeout=bound + 30)  # a hang's bound
    took = time.monotonic() - t0
    assert {e["event_id"] for e in events} == ids
    t1 = time.monotonic()
    read_events(spoke.kafka_bootstrap, ids, timeout=30)
    reading = time.monotonic() - t1
    print(f"\nevents after {took:.1f}s, {reading:.1f}s of it reading; bound {bound:.1f}s")
    assert took - reading < bound + 5, \
        f"events after {took:.1f}s ({reading:.1f}s of it reading), the bound is {bound:.1f}s"
    check(spoke, results, "fault", lease_ttl=LEASE_TTL)  # no slot, reservation or duplicate
    return events


def test_envoy_killed_mid_stream(envoy_spoke: tuple[Spoke, dict[str, str]]) -> None:
    """No record will ever come: the heartbeats stop, the admissions are given up, and the
    sweep bills each stream what its last heartbeat had seen."""
    spoke, keys = envoy_spoke
    streams = Streams(spoke, keys["fault"], n=3, tokens=2000)  # 40 s each
    # A checkpoint for each (it was a 2.5-heartbeat sleep: a loaded machine's first
    # heartbeat can come later): the usage so far, stored with a renewal, "prompt:completion"
    r = redis.Redis.from_url(spoke.redis_url)
    rids = [s.request_id for s in streams.results]

    def checkpointed(rid: str) -> bool:
        u = r.hget(f"gw:req:{rid}", "u")
        return u is not None and int(u.split(b":")[1]) > 0

    until(lambda: all(checkpointed(rid) for rid in rids), 20, "a checkpoint for each stream")
    spoke["envoy"].kill()
    results = streams.join()
    events = settled_within(spoke, results, BOUND)
    for e in events:
        assert e["outcome"] == "upstream_error"
        assert e["usage_source"] == "checkpoint", e
        assert 0 < int(e["usage"]["completion_tokens"]) < 2000, e


def test_records_unreachable_longer_than_envoy_retries(tmp_path: Path) -> None:
    """Envoy's way to the sidecar's gRPC port (records, heartbeats) is cut and stays cut
    past Envoy's ~36 s of retries; the Check (the HTTP door) still works. The streams end
    normally, their records are lost, and the sweep bills them."""
    proxies: list[SlowProxy] = []

    def via_proxy(ports: EnvoyPorts, metering: Metering) -> str:
        proxy = SlowProxy(int(ports.sidecar.rsplit(":", 1)[1])).start()
        proxies.append(proxy)
        return render(EnvoyPorts(listen=ports.listen, sidecar=f"127.0.0.1:{proxy.port}",
                                 engine=ports.engine, admin=ports.admin,
                                 authz_http=ports.authz_http),
                      metering=metering, heartbeat_s=HEARTBEAT)

    spoke, keys = spoke_with(tmp_path, via_proxy)
    try:
        streams = Streams(spoke, keys["fault"], n=2, tokens=150)  # 3 s each
        # Cut mid-stream, once each stream's first heartbeat came through (it was a fixed
        # 1.5-heartbeat sleep: a loaded machine's could have overshot the streams' ends).
        r = redis.Redis.from_url(spoke.redis_url)
        until(lambda: all(r.hget(f"gw:req:{s.request_id}", "u") for s in streams.results),
              20, "a heartbeat for each stream")
        proxies[0].stop()  # refused from now on: Envoy retries, then drops the records
        results = streams.join()
        assert all(r.completed for r in results)  # the clients never noticed
        events = settled_within(spoke, results, BOUND)
        assert {e["outcome"] for e in events} == {"upstream_error"}  # billed as orphans
    finally:
        spoke.stop()


def test_a_record_the_sidecar_cannot_read(tmp_path: Path) -> None:
    """Records whose Check facts are garbled: each request is handed to the sweep at once
    and billed from what its admission stored, instead of passing as a free denial."""
    def garbled(ports: EnvoyPorts, metering: Metering) -> str:
        config = yaml.safe_load(render(ports, metering=metering, heartbeat_s=HEARTBEAT))
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        [otel] = [a for a in hcm["typed_config"]["access_log"]
                  if a["name"] == "envoy.access_loggers.open_telemetry"]
        for kv in otel["typed_config"]["attributes"]["values"]:
            if kv["key"] == "authz":
                kv["value"]["string_value"] = "garbled " + kv["value"]["string_value"]
        return yaml.safe_dump(config, sort_keys=False)

    spoke, keys = spoke_with(tmp_path, garbled)
    try:
        results = []
        for stream in (False, True, True):
            r = httpx.post(f"{spoke.base_url}/chat/completions", timeout=30,
                           headers={"authorization": f"Bearer {keys['fault']}"},
                           json={"model": "mock-model", "max_tokens": 5, "stream": stream,
                                 "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            results.append(Result("stream" if stream else "plain", 200,
                                  r.headers["x-request-id"], True))
        events = settled_within(spoke, results, LEASE_TTL / 3 + 2)  # the next sweep
        assert {e["outcome"] for e in events} == {"upstream_error"}
        assert {e["key_id"] for e in events} == {"fault"}  # named from the admission
        metrics = httpx.get(f"{spoke.metrics_url}/metrics").text
        assert "gateway_envoy_records_unreadable_total 3.0" in metrics
    finally:
        spoke.stop()
