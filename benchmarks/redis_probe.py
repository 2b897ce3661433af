"""What a sidecar did to its Redis, read from the outside: admission script calls (to see
batching) and concurrency leases still held (to see leaks)."""

from __future__ import annotations

import time

from redis import Redis


class RedisProbe:
    """Reads what the sidecar did to Redis: Lua calls (batching) and held concurrency leases."""

    def __init__(self, url: str, key_id: str, start_ttl_s: float) -> None:
        self.client = Redis.from_url(url, socket_timeout=5)
        self.key_id = key_id
        self.start_ttl_s = start_ttl_s

    def lua_calls(self) -> int:
        stats = self.client.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0))
                   for c in ("evalsha", "eval"))

    def live_leases(self) -> int:
        """Unexpired leases of the key once they stop draining: admissions whose client left
        before ext_proc began hold theirs for the start TTL, so wait up to that long for the
        count to reach 0."""
        deadline = time.monotonic() + self.start_ttl_s + 1.5
        while True:
            now_ms = int(time.time() * 1000)
            n = int(self.client.zcount(f"gw:conc:key:{self.key_id}", now_ms, "+inf"))
            if n == 0 or time.monotonic() > deadline:
                return n
            time.sleep(0.1)

    def close(self) -> None:
        self.client.close()
