"""One real spoke per session (Redis, Tansu, mock engine, sidecar, Envoy). Tests that kill
parts of the spoke start their own (`fresh_spoke`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from spokekit import start_spoke

from gateway.dev.stack import Spoke


@pytest.fixture(scope="session")
def spoke_and_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Spoke, dict]]:
    spoke, keys = start_spoke(tmp_path_factory.mktemp("spoke"))
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


@pytest.fixture
def fresh_spoke(tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = start_spoke(tmp_path / "spoke")
    yield spoke, keys
    spoke.stop()


