"""The policy an instance serves, kept current from Redis or from a file.

Redis mode: load at start, then on every announcement and every `recheck` seconds (a missed
announcement heals itself). Each attempt at a new revision is ACKed or NACKed; a NACKed
revision leaves the previous one serving. Redis down: keep serving what we hold.
File mode (embedded): reload when the file changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from redis import exceptions as redis_errors

from gateway import metrics
from gateway.errors import PolicyError
from gateway.log import log
from gateway.policy import loader
from gateway.policy.model import Policy
from gateway.policy.store import ANNOUNCE, PolicyStore
from gateway.tasks import cancel_all, watched

_REDIS_DOWN = (redis_errors.RedisError, OSError, TimeoutError)


class PolicyHolder:
    def __init__(self) -> None:
        self.policy: Policy | None = None
        self.rejected: dict[int, str] = {}  # revision → error, so a bad one is NACKed once
        # Called after each revision taken or refused: the hub's status reporter reports then.
        self.on_change: list[Callable[[], None]] = []

    def get(self) -> Policy | None:
        return self.policy

    def swap(self, policy: Policy) -> None:
        self.policy = policy
        metrics.POLICY_REVISION.set(policy.revision)
        metrics.READY.set(1)
        metrics.POLICY_LOADS.labels("ack").inc()
        log.info("policy_loaded", revision=policy.revision, keys=len(policy.keys))
        self._changed()

    def reject(self, revision: int, error: str) -> None:
        self.rejected[revision] = error
        metrics.POLICY_LOADS.labels("nack").inc()
        log.error("policy_rejected", revision=revision, error=error)
        self._changed()

    def verdict(self) -> tuple[str, str | None]:
        """("nack", error) while the newest revision seen was refused, else ("ack", None)."""
        held = self.policy.revision if self.policy else 0
        newest = max(self.rejected, default=0)
        return ("nack", self.rejected[newest]) if newest > held else ("ack", None)

    def _changed(self) -> None:
        for fn in self.on_change:
            fn()


class RedisPolicySync:
    def __init__(self, holder: PolicyHolder, store: PolicyStore, instance_id: str,
                 recheck: float) -> None:
        self.holder = holder
        self.store = store
        self.instance_id = instance_id
        self.recheck = recheck
        self._tasks: list[asyncio.Task[None]] = []

    def _unseen(self, revision: int) -> bool:
        """Neither held nor rejected already."""
        return revision != self.held and revision not in self.holder.rejected

    async def refresh(self) -> None:
        """Load the current revision if it is new; ACK or NACK it. Never raises for Redis."""
        try:
            await self.store.follow_primary()
            # The revision first: the document (as large as the key list) only when it is
            # one not seen yet, not at every recheck.
            latest = await self.store.current_revision()
            if not latest:
                return
            if self._unseen(latest):
                stored = await self.store.current()
                if stored is None:
                    return
                latest = stored.revision  # a newer one may have come between the two reads
                if self._unseen(latest):
                    try:
                        self.holder.swap(loader.load(stored.text, latest, f"revision {latest}"))
                    except PolicyError as err:
                        self.holder.reject(latest, str(err))
            error = self.holder.rejected.get(latest)
            await self.store.report(self.instance_id, self.held, latest, error)
        except _REDIS_DOWN as exc:
            log.warning("policy_refresh_failed", error=str(exc))

    @property
    def held(self) -> int:
        return self.holder.policy.revision if self.holder.policy else 0

    def start(self) -> None:
        self._tasks = [watched(self._poll(), "policy_poll"),
                       watched(self._listen(), "policy_listen")]

    async def stop(self) -> None:
        await cancel_all(self._tasks)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.recheck)
            try:
                await self.refresh()
            except Exception:  # a background loop must outlive any one bad refresh
                log.exception("policy_refresh_crashed")

    async def _listen(self) -> None:
        """Announcements make a new revision take effect in milliseconds, not `recheck`."""
        while True:
            try:
                async with self.store.redis.pubsub() as ps:
                    await ps.subscribe(ANNOUNCE)
                    await self.refresh()  # anything published while we were not listening
                    async for msg in ps.listen():
                        if msg.get("type") == "message":
                            await self.refresh()
            except _REDIS_DOWN as exc:
                log.warning("policy_announce_lost", error=str(exc))
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("policy_listener_crashed")
                await asyncio.sleep(1.0)


class FilePolicySync:
    """Embedded mode: the YAML file is the policy; its mtime is the revision clock."""

    def __init__(self, holder: PolicyHolder, path: Path, interval: float = 0.5) -> None:
        self.holder = holder
        self.path = path
        self.interval = interval
        self._stamp: tuple[float, int] | None = None
        self._revision = 0
        self._task: asyncio.Task[None] | None = None

    def refresh(self) -> None:
        try:
            st = self.path.stat()
        except OSError as exc:
            log.error("policy_file_unreadable", path=str(self.path), error=str(exc))
            return
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            text = self.path.read_bytes()
        except OSError as exc:  # e.g. a directory: said, as a file that is not there is
            log.error("policy_file_unreadable", path=str(self.path), error=str(exc))
            return
        try:
            doc = loader.parse_doc(text, str(self.path))
        except PolicyError as err:
            # NACKed as the revision it would have been (the hub's status reports it); the
            # one held keeps serving, and the next good edit takes that number
            self.holder.reject(max(self._revision + 1, 1), str(err))
            return
        self._revision = max(self._revision + 1, doc.revision or 0)
        self.holder.swap(Policy.compile(doc, self._revision))

    def start(self) -> None:
        self._task = watched(self._poll(), "policy_file_poll")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.refresh()
            except Exception:
                log.exception("policy_refresh_crashed")
