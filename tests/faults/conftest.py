"""The fault suite: a fresh spoke per fault (they kill its parts), a short lease TTL so
swept orphans show up within the test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devspoke.stack import Spoke
from gateway.settings import DEFAULT_METERING, METERING_SOURCES
from testkit.spoke import start_spoke

LEASE_TTL = 3.0
# `make faults` sets this to 60 for the full minute-long Kafka outage.
KAFKA_OUTAGE_S = float(os.environ.get("FAULT_KAFKA_OUTAGE_S", "8"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each fault against both metering sources, but for faults that end at the Check
    (marked authz_only), which one source proves."""
    if "spoke_keys" in metafunc.fixturenames:
        one = metafunc.definition.get_closest_marker("authz_only") is not None
        metafunc.parametrize("spoke_keys", (DEFAULT_METERING,) if one else METERING_SOURCES,
                             indirect=True)


@pytest.fixture
def spoke_keys(request: pytest.FixtureRequest,
               tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = start_spoke(tmp_path / "spoke", metering=request.param, sidecar_env={
        "GATEWAY_LEASE_TTL_S": str(LEASE_TTL), "GATEWAY_REDIS_DEADLINE_MS": "250"})
    yield spoke, keys
    spoke.stop()
