"""`gateway policy sync`'s /metrics leaves out a sidecar's gauges: at 0 there they read as a
sidecar without a policy and with its Redis down."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from gateway import metrics
from gateway.ops_http import syncer_metrics_handler


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_the_syncer_shows_its_own_metrics_and_no_sidecar_gauge() -> None:
    metrics.sync_gauges()
    every = _families(generate_latest().decode())
    assert every >= metrics.SIDECAR_GAUGES  # the names are the registry's (a rename fails)
    status, _, body = asyncio.run(syncer_metrics_handler())
    shown = _families(body.decode())
    assert status == 200 and not shown & metrics.SIDECAR_GAUGES
    assert {"gateway_hub_feed_up", "gateway_hub_sync_revisions_total"} <= shown
    assert shown == every - metrics.SIDECAR_GAUGES
