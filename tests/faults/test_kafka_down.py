"""The broker stopped under streaming load through Envoy for FAULT_KAFKA_OUTAGE_S (8 s;
`make faults`: a minute): the clients never notice, the events wait in the spool and all
reach the topic once it is back, then the same invariants (invariants.py)."""

from __future__ import annotations

import time

from conftest import KAFKA_OUTAGE_S, LEASE_TTL
from probes import Spk

from testkit.invariants import check
from testkit.load import Load


def test_kafka_down_under_streaming_load_loses_nothing(spoke_keys: Spk) -> None:
    spoke, keys = spoke_keys
    spoke["kafka"].stop()
    load = Load(spoke.base_url, keys["fault"], concurrency=6).start()
    time.sleep(KAFKA_OUTAGE_S)
    assert all(r.status == 200 for r in load.results)  # the clients never noticed
    spoke["kafka"].restart()
    time.sleep(2)
    results = load.stop()
    stats = check(spoke, results, "fault", lease_ttl=LEASE_TTL)
    assert stats["events"] >= stats["admitted"] > 20
