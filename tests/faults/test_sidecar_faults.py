"""The sidecar killed (SIGKILL) or frozen (SIGSTOP) under live traffic through Envoy, then
the same invariants (invariants.py). Its store's faults are test_redis_faults.py's."""

from __future__ import annotations

import time

from conftest import LEASE_TTL
from probes import Spk, served, serving_again, status

from gateway.cli import main as gateway
from testkit.invariants import check
from testkit.load import Load


def test_sidecar_killed_mid_stream_then_restarted(spoke_keys: Spk) -> None:
    spoke, keys = spoke_keys
    load = Load(spoke.base_url, keys["fault"], concurrency=8).start()
    served(load)
    spoke["sidecar"].kill()
    time.sleep(1)  # the outage: 1 s (docs/envoy.md and docs/benchmarks.md cite it)
    down = len(load.results)
    spoke["sidecar"].restart()
    serving_again(load, down)
    results = load.stop()
    assert all(r.seconds < 15 for r in results)  # nobody hung
    assert any(r.status == 503 or r.error for r in results[down - 10:down])
    assert results[-1].status == 200
    stats = check(spoke, results, "fault", lease_ttl=LEASE_TTL)
    db = f"sqlite:///{spoke.workdir}/u.db"
    assert gateway(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                    "--until-caught-up"]) == 0
    assert gateway(["usage", "reconcile", "--db", db,
                    "--spool-dir", str(spoke.workdir / "spool")]) == 0  # no gap, none spooled
    assert stats["admitted"] > 20
    if spoke.metering == "envoy":
        # Envoy kept every record of the outage and sent it again once the sidecar was back:
        # each request's event carries its real usage, none is an orphan's zero.
        assert stats["outcomes"].get("upstream_error", 0) == 0, stats
        assert stats["orphans"] == 0, stats


def test_sidecar_paused_then_resumed(spoke_keys: Spk) -> None:
    spoke, keys = spoke_keys
    load = Load(spoke.base_url, keys["fault"], concurrency=4).start()
    served(load)
    spoke["sidecar"].pause()  # SIGSTOP: Envoy's timeouts answer for it
    code, took = status(spoke, keys["fault"])
    # ext_authz timeout (0.5 s) → 503; the sidecar stays frozen until after this answer, so
    # the bound only tells the timeout from a hang (as in test_check_unanswered), and leaves
    # a loaded machine room (it was 1.5 s: 1 s for a loaded Envoy, client and load threads)
    assert code == 503 and took < 5
    time.sleep(2)  # frozen for 2.5 s in all, under load
    resumed = len(load.results)
    spoke["sidecar"].resume()
    serving_again(load, resumed)
    results = load.stop()
    assert results[-1].status == 200
    check(spoke, results, "fault", lease_ttl=LEASE_TTL)  # nothing counted twice
