"""One real spoke per session and metering source (Redis, Tansu, mock engine, sidecar,
Envoy). Tests that kill parts of the spoke start their own (`fresh_spoke`).

Every test runs against both metering sources, except in modules that set
`AUTHZ_ONLY = True`: what they test happens before metering (the Check, Envoy's path
handling), so they run against the default source only, once through each of the Check's
doors: the sidecar's HTTP door (as `gateway dev` runs it) and the gRPC Check (as the
reference envoy/envoy.yaml). Modules that set `ALSO_GRPC_CHECK = True` run against both
sources and the default source with the gRPC Check too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devspoke.stack import Spoke
from gateway.settings import DEFAULT_METERING, METERING_SOURCES
from testkit.spoke import start_spoke

# A session spoke: (metering source, Check through the HTTP door? None: the spoke's default)
GRPC_CHECK = f"{DEFAULT_METERING}-grpc-check"
FLAVOURS: dict[str, tuple[str, bool | None]] = {
    **{source: (source, None) for source in METERING_SOURCES},
    GRPC_CHECK: (DEFAULT_METERING, False)}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "spoke_and_keys" in metafunc.fixturenames:
        flavours: tuple[str, ...] = METERING_SOURCES
        if getattr(metafunc.module, "AUTHZ_ONLY", False):
            flavours = (DEFAULT_METERING, GRPC_CHECK)
        elif getattr(metafunc.module, "ALSO_GRPC_CHECK", False):
            flavours = (*METERING_SOURCES, GRPC_CHECK)
        metafunc.parametrize("spoke_and_keys", flavours, indirect=True, scope="session")


@pytest.fixture(scope="session")
def spoke_and_keys(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Spoke, dict]]:
    """One spoke per flavour (the parameter), shared by the session."""
    metering, door = FLAVOURS[request.param]
    spoke, keys = start_spoke(tmp_path_factory.mktemp("spoke"), metering=metering,
                              authz_http=door)
    yield spoke, keys
    spoke.stop()


@pytest.fixture
def spoke(spoke_and_keys: tuple[Spoke, dict[str, str]]) -> Spoke:
    s = spoke_and_keys[0]
    httpx.post(f"{s.engine_url}/mock/reset")
    return s


@pytest.fixture
def keys(spoke_and_keys: tuple[Spoke, dict[str, str]]) -> dict[str, str]:
    return spoke_and_keys[1]


@pytest.fixture(params=METERING_SOURCES)
def fresh_spoke(request: pytest.FixtureRequest,
                tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = start_spoke(tmp_path / "spoke", metering=request.param)
    yield spoke, keys
    spoke.stop()


