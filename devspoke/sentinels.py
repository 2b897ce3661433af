"""Redis as production runs it, for the tests and benchmarks: a primary, a replica and three
Sentinels (quorum 2), each a real `redis-server` on a free port (Debian's: a Sentinel is
`redis-server FILE --sentinel`)."""

from __future__ import annotations

import time
from pathlib import Path

from devspoke.procs import LOOPBACK, Service, free_port, redis_service, sentinel_service

SERVICE = "spoke"


def sentinel_set(workdir: Path, down_after_ms: int = 1000) -> dict[str, Service]:
    """Not started yet, in start order: "redis" (the primary), "redis-replica",
    "sentinel-0".."sentinel-2"."""
    primary = redis_service(free_port(), workdir)
    out = {"redis": primary,
           "redis-replica": redis_service(free_port(), workdir, replica_of=primary.address)}
    for i in range(3):
        out[f"sentinel-{i}"] = sentinel_service(free_port(), workdir, SERVICE, primary.address,
                                                down_after_ms)
    return out


def sentinel_url(services: dict[str, Service], db: int = 0) -> str:
    hosts = ",".join(svc.address for name, svc in services.items()
                     if name.startswith("sentinel-"))
    return f"redis+sentinel://{hosts}/{SERVICE}/{db}"


def wait_sentinels(services: dict[str, Service], timeout: float = 30.0) -> None:
    """Block until every Sentinel knows a primary, a replica and the other two Sentinels
    (they meet through hello messages every 2 s): before that no failover can happen."""
    import redis

    deadline = time.monotonic() + timeout
    for name, svc in services.items():
        if not name.startswith("sentinel-"):
            continue
        with redis.Redis(host=LOOPBACK, port=svc.port, socket_timeout=2) as client:
            while True:
                state = client.sentinel_master(SERVICE)
                if state["num-other-sentinels"] == 2 and state["num-slaves"] >= 1:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} does not see the whole set: {state}")
                time.sleep(0.1)


def primary_port(services: dict[str, Service]) -> int:
    """The port of the primary the first Sentinel names now."""
    import redis

    svc = services["sentinel-0"]
    with redis.Redis(host=LOOPBACK, port=svc.port, socket_timeout=2) as client:
        _, port = client.sentinel_get_master_addr_by_name(SERVICE)
    return int(port)
