"""Policy revisions in Redis (DESIGN §2): apply, read, announce, and per-instance ACK/NACK.

    gw:policy            hash {revision, doc}: the current revision (doc as JSON)
    gw:policy:announce   pub/sub channel: a new revision number
    gw:policy:status     hash instance_id → JSON {revision, state: ACK|NACK, error, seen_at}
    gw:policy:sync       hash syncer id → JSON {feed, feed_error, feed_revision, revision,
                         state, error, seen_at}: each `policy sync` follower of the hub's feed
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool

from gateway.errors import RevisionConflict
from gateway.policy.loader import parse_doc, to_data
from gateway.policy.schema import PolicyDoc

POLICY_KEY = "gw:policy"
ANNOUNCE = "gw:policy:announce"
STATUS_KEY = "gw:policy:status"
SYNC_KEY = "gw:policy:sync"

# Compare-and-set: store revision ARGV[1] with doc ARGV[2] only if it is newer than the
# current one and (when ARGV[3] is not '') the current one is still ARGV[3].
_APPLY = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'revision') or 0)
local new = tonumber(ARGV[1])
if ARGV[3] ~= '' and cur ~= tonumber(ARGV[3]) then return {-1, cur} end
if new <= cur then return {-2, cur} end
redis.call('HSET', KEYS[1], 'revision', new, 'doc', ARGV[2])
redis.call('PUBLISH', KEYS[2], new)
return {new, cur}
"""


@dataclass(frozen=True)
class Stored:
    revision: int
    text: bytes  # the document as JSON, to be validated by whoever loads it


class PolicyStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._apply = redis.register_script(_APPLY)

    async def follow_primary(self) -> None:
        """Under Sentinel, ask the Sentinels now: redis-py asks only on connect, so an idle
        connection would stay on a primary they no longer name (a partitioned one keeps
        taking writes a failover then discards). A changed answer drops idle connections."""
        pool = self.redis.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            await pool.get_master_address()

    async def current(self) -> Stored | None:
        rev, doc = await self.redis.hmget(POLICY_KEY, ["revision", "doc"])
        if rev is None or doc is None:
            return None
        return Stored(int(rev), doc if isinstance(doc, bytes) else doc.encode())

    async def current_revision(self) -> int:
        rev = await self.redis.hget(POLICY_KEY, "revision")
        return int(rev or 0)

    async def publish(self, doc: PolicyDoc, expect: int | None = None) -> int:
        """Store `doc` as the next revision (or its own `revision`, if newer) and announce it."""
        cur = await self.current_revision()
        new = doc.revision if doc.revision else cur + 1
        body = orjson.dumps(to_data(doc))
        res = await self._apply(keys=[POLICY_KEY, ANNOUNCE],
                                args=[new, body, "" if expect is None else expect])
        code, held = int(res[0]), int(res[1])
        if code == -1:
            raise RevisionConflict(f"revision moved to {held} while editing; try again")
        if code == -2:
            raise RevisionConflict(f"revision {new} is not newer than the current {held}")
        return code

    async def publish_raw(self, revision: int, body: bytes) -> int:
        """Store an unvalidated document (what a buggy hub could do); instances NACK it."""
        res = await self._apply(keys=[POLICY_KEY, ANNOUNCE], args=[revision, body, ""])
        return int(res[0])

    async def load_doc(self) -> tuple[int, PolicyDoc] | None:
        stored = await self.current()
        if stored is None:
            return None
        return stored.revision, parse_doc(stored.text, f"revision {stored.revision}")

    async def report(self, instance_id: str, held: int, latest: int, error: str | None) -> None:
        """ACK: this instance serves `latest`. NACK: it rejected `latest` and keeps `held`."""
        entry = {
            "revision": held,
            "latest": latest,
            "state": "NACK" if error else "ACK",
            "error": error,
            "seen_at": time.time(),
        }
        await self.redis.hset(STATUS_KEY, instance_id, orjson.dumps(entry))

    async def statuses(self) -> dict[str, dict[str, Any]]:
        raw = await self.redis.hgetall(STATUS_KEY)
        return {
            (k.decode() if isinstance(k, bytes) else k): orjson.loads(v) for k, v in raw.items()
        }

    async def report_sync(self, syncer: str, entry: dict[str, Any]) -> None:
        """A syncer's own line for `policy status`: is the hub's feed reachable, what it holds."""
        await self.redis.hset(SYNC_KEY, syncer, orjson.dumps({**entry, "seen_at": time.time()}))

    async def sync_statuses(self) -> dict[str, dict[str, Any]]:
        raw = await self.redis.hgetall(SYNC_KEY)
        return {
            (k.decode() if isinstance(k, bytes) else k): orjson.loads(v) for k, v in raw.items()
        }
