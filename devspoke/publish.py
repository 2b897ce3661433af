"""Publishing a policy to a spoke's Redis the way `gateway policy apply` does: the one path
`gateway dev`, the tests and the benchmarks load their policies through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import yaml

from gateway.policy import admin
from gateway.policy.store import PolicyStore
from gateway.redis_clients import policy_client
from gateway.settings import Settings


@asynccontextmanager
async def policy_backend(redis_url: str) -> AsyncIterator[admin.RedisBackend]:
    """The policy store on `redis_url`, its connection closed on the way out."""
    client = policy_client(redis_url, Settings().redis_deadline_ms / 1000)
    try:
        yield admin.RedisBackend(PolicyStore(client))
    finally:
        await client.aclose()


def publish(redis_url: str, doc: dict[str, Any], source: str, *, prune: bool = False) -> int:
    """Publish `doc` (a policy file's structure) as the next revision; that revision.

    `prune` drops keys the document no longer names (a hub re-publishing its whole view).
    """
    async def go() -> int:
        async with policy_backend(redis_url) as backend:
            done = await admin.apply(backend, yaml.safe_dump(doc).encode(), source, prune=prune)
        assert done.revision is not None
        return done.revision

    return asyncio.run(go())
