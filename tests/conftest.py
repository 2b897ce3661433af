"""Shared fixtures: real servers on free ports, started by the tests so they can kill them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devspoke.procs import Service, free_port, redis_service


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def redis_server(session_dir: Path) -> Iterator[Service]:
    svc = redis_service(free_port(), session_dir)
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture
def redis_url(redis_server: Service) -> str:
    """A clean database on the session's Redis (restarted if an earlier test killed it)."""
    if not redis_server.alive:
        redis_server.start()
    url = f"redis://{redis_server.address}/0"
    redis.Redis.from_url(url).flushall()
    return url
