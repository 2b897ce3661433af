"""`gateway policy sync`: the spoke's follower of the hub (DESIGN §10), a set of concurrent
tasks: the policy feed, a Redis guard, the status heartbeat and /metrics. (Another follower,
e.g. quota allowances, is one more task: `run_sync(..., extra=[...])`; its state, given as
`allowances`, goes into the syncer's row of `policy status`.)

Each round brings the spoke's Redis to the feed's entry for this spoke (its own, else `*`)
through the path `policy apply` uses: validated, then stored by the compare-and-set script
as exactly the feed's revision, so Redis and the feed can be compared. Never a lower
revision; an invalid one is NACKed upward and never reaches Redis. Kafka away: Redis keeps
what it holds and the feed is retried. Redis wiped: the last good revision on disk goes
back. Restarted: the feed is read again from its start, and nothing not newer than Redis is
applied again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis import exceptions as redis_errors

from gateway import metrics
from gateway.errors import RevisionConflict
from gateway.hub import feed
from gateway.hub.last_good import LastGood
from gateway.hub.status import Status, StatusReporter, now_text
from gateway.hub.topics import POLICY_TOPIC, Follower
from gateway.log import log
from gateway.policy.store import PolicyStore
from gateway.settings import Settings
from gateway.tasks import cancel_all, stop_on_signals

if TYPE_CHECKING:
    from gateway.hub.allowances import FollowerState

_REDIS_DOWN = (redis_errors.RedisError, OSError, TimeoutError)
DISK = "last good revision on disk"


def default_id() -> str:
    """Stable across restarts, so a restarted syncer keeps its one line in `hub status`."""
    return f"sync-{socket.gethostname()}"


class Syncer:
    def __init__(self, spoke: str, syncer_id: str, store: PolicyStore, bootstrap: str,
                 state_dir: Path, *, interval: float = 10.0, recheck: float = 5.0,
                 idempotence: bool = True, allowances: FollowerState | None = None,
                 replication: int = 1) -> None:
        self.spoke = spoke
        self.allowances = allowances  # the allowance follower's, shown in our row
        self.id = syncer_id
        self.store = store
        self.recheck = recheck
        self.feed = Follower(bootstrap, POLICY_TOPIC, probe_s=min(2.0, recheck))
        self.current: dict[str, bytes] = {}  # the feed now: key → value
        self.last_good = LastGood(state_dir / f"{spoke}.json").load()
        self.held = 0  # the revision the spoke's Redis holds, as last read
        self.redis_up = False
        self.refused: tuple[bytes, str] | None = None  # the entry refused, and why
        metrics.sync_gauges()  # shown from the start, at 0 until the first round
        self.reporter = StatusReporter(bootstrap, self.status, interval, idempotence,
                                       replication)
        self._lock = asyncio.Lock()

    def status(self) -> Status:
        return Status(self.spoke, self.id, self.held, "nack" if self.refused else "ack",
                      self.refused[1] if self.refused else None, now_text(), 0, 0.0,
                      self.redis_up)

    async def sync_once(self) -> None:
        """One round: restore from disk if Redis lost it, then follow the feed's entry."""
        async with self._lock:
            await self.store.follow_primary()
            held = self.held = await self.store.current_revision()
            self._set_redis_up(True)
            if self.last_good.raw is not None and self.last_good.revision > held:
                await self._restore(self.last_good.raw)
            entry = feed.entry_for(self.current, self.spoke)
            if entry is None:
                self._set_refused(None)
            else:
                key, raw = entry
                await self._take(feed.decide(f"{POLICY_TOPIC}[{key}]", raw, self.held), raw)
            _, feed_revision, held_revision = metrics.sync_gauges()
            held_revision.set(self.held)  # both last: a round ended here
            feed_revision.set(feed.feed_revision(self.current, self.spoke) or 0)
            await self.store.report_sync(self.id, {
                "feed": "up" if self.feed.up else "down", "feed_error": self.feed.error,
                "feed_revision": feed.feed_revision(self.current, self.spoke),
                "revision": self.held, "state": "NACK" if self.refused else "ACK",
                "error": self.refused[1] if self.refused else None,
                **({"allowances": dataclasses.asdict(self.allowances)}
                   if self.allowances is not None else {})})

    async def _restore(self, raw: bytes) -> None:
        decision = feed.decide(DISK, raw, self.held)
        if isinstance(decision, feed.Apply):
            await self._apply(decision, "restored")
        elif isinstance(decision, feed.Refuse):  # e.g. written by an older, laxer version
            log.error("last_good_refused", error=decision.error)

    async def _take(self, decision: feed.Decision, raw: bytes) -> None:
        if isinstance(decision, feed.Apply):
            await self._apply(decision, "applied")
        elif isinstance(decision, feed.Refuse):
            self._set_refused((raw, decision.error))
        else:
            self._set_refused(None)

    async def _apply(self, decision: feed.Apply, result: str) -> None:
        await self.store.publish(decision.doc, expect=self.held)  # CAS: RevisionConflict
        self.held = decision.revision
        self.last_good.save(decision.revision, decision.doc)
        metrics.SYNC_REVISIONS.labels(result).inc()
        log.info("hub_revision_" + result, spoke=self.spoke, revision=decision.revision)
        self.refused = None
        self.reporter.poke()

    def _set_refused(self, refused: tuple[bytes, str] | None) -> None:
        if refused == self.refused:
            return  # NACKed once; the NACK stays until the entry changes
        self.refused = refused
        if refused:
            metrics.SYNC_REVISIONS.labels("refused").inc()
            log.error("hub_revision_refused", spoke=self.spoke, error=refused[1])
        self.reporter.poke()

    async def _round(self) -> None:
        try:
            await self.sync_once()
        except RevisionConflict as exc:  # another syncer of this spoke was first: re-read
            log.info("hub_sync_conflict", error=str(exc))
            metrics.SYNC_ERRORS.labels("conflict").inc()
        except _REDIS_DOWN as exc:
            if self.redis_up:
                log.warning("hub_sync_redis_unreachable", error=str(exc))
            self._set_redis_up(False)
            metrics.SYNC_ERRORS.labels("redis").inc()
        except Exception:  # e.g. a revision in Redis that is no integer: the next round may
            # find it fixed; raised, it ended every task, and `policy sync` with them
            log.exception("hub_sync_round_failed", spoke=self.spoke)
            metrics.SYNC_ERRORS.labels("failed").inc()

    def _set_redis_up(self, up: bool) -> None:
        if up != self.redis_up:
            self.redis_up = up
            self.reporter.poke()  # the hub hears of it at once, not at the next heartbeat

    async def follow_feed(self) -> None:
        """The feed into `self.current`. A read from the topic's start (first, or after
        Kafka was away) replaces it only once it reached the end: partitions are read in
        no order between them, and a half-read feed could offer a spoke a `*` revision
        that its own entry, further on, overrides."""
        generation, reading = 0, True
        pending: dict[str, bytes] = {}
        async for records in self.feed.batches():
            metrics.sync_gauges()[0].set(1 if self.feed.up else 0)
            if not self.feed.up:
                metrics.SYNC_ERRORS.labels("kafka").inc()
            if self.feed.generation != generation:
                generation, pending, reading = self.feed.generation, {}, True
            if reading:
                pending = feed.latest([*pending.items(), *records])
                if self.feed.caught_up:
                    self.current, reading = pending, False
            else:
                self.current = feed.latest([*self.current.items(), *records])
            await self._round()

    async def guard_redis(self) -> None:
        """Rounds with or without the feed: a wiped Redis gets the last good revision back
        while the hub is away."""
        while True:
            await self._round()
            await asyncio.sleep(self.recheck)

    def tasks(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        return [self.follow_feed, self.guard_redis, self.reporter.run]


async def run_sync(settings: Settings, syncer_id: str,
                   extra: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
                   allowances: FollowerState | None = None) -> None:
    """Run the syncer's tasks (and `extra` followers) until SIGTERM/SIGINT; `allowances`:
    the allowance follower's state, for the syncer's row of `policy status`."""
    from gateway.addresses import split_hostport
    from gateway.ops_http import healthz, serve_http, syncer_metrics_handler
    from gateway.redis_clients import policy_client

    bootstrap = settings.feed_bootstrap
    if not settings.redis_url or not bootstrap:
        raise SystemExit("policy sync needs GATEWAY_REDIS_URL (the spoke) and "
                         "GATEWAY_HUB_BOOTSTRAP or GATEWAY_KAFKA_BOOTSTRAP (the hub's Kafka)")
    host, port = split_hostport(settings.sync_metrics_listen, "GATEWAY_SYNC_METRICS_LISTEN")
    client = policy_client(settings.redis_url, settings.redis_deadline_ms / 1000)
    syncer = Syncer(settings.spoke, syncer_id, PolicyStore(client), bootstrap,
                    settings.sync_state_dir, interval=settings.status_interval_s,
                    recheck=settings.policy_recheck_s,
                    idempotence=settings.kafka_idempotence, allowances=allowances,
                    replication=settings.topic_replication)
    http = await serve_http(host, port, {"/metrics": syncer_metrics_handler, "/healthz": healthz})
    log.info("hub_sync_started", spoke=settings.spoke, id=syncer_id, feed=bootstrap,
             last_good=syncer.last_good.revision, metrics=settings.sync_metrics_listen)
    tasks = [asyncio.create_task(fn()) for fn in [*syncer.tasks(), *extra]]
    stop = stop_on_signals()
    done = asyncio.create_task(stop.wait())
    finished, _ = await asyncio.wait([done, *tasks], return_when=asyncio.FIRST_COMPLETED)
    await cancel_all([done, *tasks])
    http.close()
    with contextlib.suppress(Exception):
        await client.aclose()
    for t in finished:
        if t is not done and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
