"""A durable, append-only spool of usage events: the only place an event is ever "sent" to.

Layout: `<root>/<instance_id>/` holds segment files named by their first seq
(`00000000000000000001.log`, JSON lines in seq order), `delivered` (the highest seq Kafka
acknowledged) and `LOCK` (held with flock by the live owner). An instance *is* its spool:
seq continues from the spool after a restart, so it is gap-free per instance.

`append` never blocks the request path: it assigns the seq and queues the line; a writer
task has the spool's own thread write and fsync queued lines together (group commit; a
thread of its own, not asyncio.to_thread's pool: half the CPU per hand-off, and at low
rates there is one per request), then wakes the shipper,
which takes them in order from memory (the lines just made durable), or reads them back
from the files when it fell behind by more than RECENT_MAX (the sink away, a restart).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gateway import metrics
from gateway.errors import SpoolLocked, SpoolUnusable
from gateway.log import log
from gateway.sinks.disk_thread import DiskThread
from gateway.sinks.gate import UsageGate
from gateway.sinks.segments import Segments

T = TypeVar("T")

SEGMENT_BYTES = 64 << 20
# Lines just made durable, kept in memory for the shipper (seq order, contiguous): it sends
# them without reading the file back. Past this many (the sink is away) it reads the files.
RECENT_MAX = 10_000  # ~7 MB of typical events
# The last lines found at open (of the last segment), kept as `Spool.tail`: the events a
# crash may have left unsettled (App re-sends their settlements, gateway/server/app.py).
TAIL_MAX = 10_000


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Spool:
    def __init__(self, root: Path, instance_id: str, segment_bytes: int = SEGMENT_BYTES,
                 gate: UsageGate | None = None) -> None:
        self.dir = root / instance_id
        self.instance_id = instance_id
        self.files = Segments(self.dir, segment_bytes)
        self.last_seq = 0  # assigned
        self.durable_seq = 0  # written and fsynced
        self.delivered = 0  # acknowledged by the sink
        self._queue: list[bytes] = []
        self._queued_seq = 0
        self._writing = 0  # lines of the group commit in progress (out of `_queue` meanwhile)
        self._persisted = 0
        self._callbacks: list[Callable[[], None]] = []
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []  # until_durable
        # When each undelivered event was put (wall clock), oldest first: the age of the
        # oldest is how long billing has been waiting on the sink. Events recovered from an
        # earlier run count from their segment file's last write.
        self._put_at: deque[tuple[int, float]] = deque()
        self._recovered = (0, 0.0)  # (last seq recovered undelivered, its segment's mtime)
        self._wake_writer = asyncio.Event()
        self.durable = asyncio.Event()  # set when durable_seq moves
        self._recent: deque[tuple[int, bytes]] = deque()  # durable lines, see RECENT_MAX
        self.tail: list[bytes] = []  # see TAIL_MAX; its reader empties it
        self.tail_written_at = 0.0  # when its segment was last written (wall clock)
        self._lock_fd: int | None = None
        self._disk: DiskThread | None = None  # started by the first group commit
        self._lingering: asyncio.Future[None] | None = None  # the writer waiting for company
        # Closed while a group commit fails, open again at the next that succeeds: the
        # Check refuses new requests meanwhile (fails closed: nothing unrecorded).
        self.gate = gate if gate is not None else UsageGate()

    # -- opening and recovery ---------------------------------------------------------

    def open(self) -> Spool:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # no events can be kept: say where, not a traceback
            raise SpoolUnusable(f"spool directory {self.dir}: {exc.strerror or exc} "
                                "(GATEWAY_SPOOL_DIR)") from exc
        self._lock_fd = self._lock(fd)
        self._recover()
        try:  # a full or read-only disk refuses now, not at the first request's event
            self.write_mark(self.delivered)
        except OSError as exc:
            os.close(fd)
            self._lock_fd = None
            raise SpoolUnusable(f"spool directory {self.dir}: cannot write: "
                                f"{exc.strerror or exc} (GATEWAY_SPOOL_DIR)") from exc
        return self

    def _lock(self, fd: int) -> int:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolLocked(f"{self.dir} is in use by a live instance") from None
        return fd

    def _append(self, first: int, data: bytes) -> None:
        """A group commit's write (disk thread). A spool directory deleted under the
        running instance is made again, its lock taken again (else a starting instance
        would adopt a live spool) and the open segment given its name back: its lines
        were written and fsynced to a file that a restart would never find."""
        if self.files.removed():
            self._relink()
        self.files.append(first, data)
        if self.files.removed():  # deleted during the write
            self._relink()

    def _relink(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = self._lock(os.open(self.dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644))
        except SpoolLocked as exc:  # another instance took the name meanwhile
            raise OSError(errno.EAGAIN, str(exc)) from None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = fd
        missing = self.files.relink()
        self.write_mark(self.delivered)  # the delivered mark went with the directory
        metrics.SPOOL_WRITE_ERRORS.inc()
        log.error("spool_directory_recreated", dir=str(self.dir), delivered=self.delivered,
                  durable_seq=self.durable_seq, segments_lost=missing)

    def close(self) -> None:
        if self._disk is not None:
            self._disk.stop()  # after the calls queued before, which it still runs
            self._disk = None
        self.files.close()
        if self._lock_fd is not None and self.delivered:
            try:
                self.persist_delivered()
            except OSError as exc:  # a restart re-sends what the older mark leaves out
                log.error("spool_mark_write_failed", dir=str(self.dir),
                          delivered=self.delivered, error=repr(exc))
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _recover(self, repair: bool = True) -> None:
        """Seq and marks from the files. A complete line is kept even when it cannot be
        parsed (the shipper sends it on, loudly); only a torn last line is cut (`repair`)."""
        mark = self.dir / "delivered"
        try:
            self.delivered = int(mark.read_text() or 0)
        except FileNotFoundError:
            pass
        except ValueError as exc:  # from the first segment on, below
            log.warning("spool_mark_unreadable", path=str(mark), error=repr(exc))
        last = self.delivered
        found = self.files.recover(repair)
        if found is not None:
            lines, self.tail_written_at = found
            self.tail = lines[-TAIL_MAX:]
            firsts = self.files.firsts
            last = firsts[-1] + len(lines) - 1
            first = firsts[0] - 1  # below the files: delivered, else dropped
            if not first <= self.delivered <= last:
                if self.delivered > last:  # a mark past what is on disk cannot be true
                    log.warning("spool_mark_past_end", path=str(mark), mark=self.delivered,
                                last_seq=last, resend_from=first + 1)
                self.delivered = first  # at-least-once: what the files hold is sent again
            if last > self.delivered:
                self._recovered = (last, self.files.path(firsts[0]).stat().st_mtime)
        self.last_seq = self.durable_seq = self._queued_seq = last
        self._persisted = self.delivered

    # -- writing ------------------------------------------------------------------------

    def next_seq(self) -> int:
        self.last_seq += 1
        return self.last_seq

    def put(self, seq: int, line: bytes, on_durable: Callable[[], None] | None = None) -> None:
        """Queue one JSON line whose seq is `seq` (from `next_seq`, put in the same order);
        `on_durable` runs once it is on disk."""
        self._queue.append(line if line.endswith(b"\n") else line + b"\n")
        self._queued_seq = seq
        self._put_at.append((seq, time.time()))
        if on_durable is not None:
            self._callbacks.append(on_durable)
        self._wake_writer.set()

    async def run_writer(self, linger: float = 0.005) -> None:
        """Group commit: the first queued line waits up to `linger` for company, so under
        load one write and one fsync serve many events (events are off the request path).
        Lines someone already waits on (`until_durable`: a batch of Envoy's records, which
        came as one group) are committed at once: the wait would only add a timer's
        wake-up and `linger` to the batch's answer."""
        loop = asyncio.get_running_loop()
        retry = 0.1
        while True:
            await self._wake_writer.wait()
            if not self._waiters:
                self._lingering = loop.create_future()
                timer = loop.call_later(linger, _resolve, self._lingering)
                await self._lingering
                timer.cancel()
                self._lingering = None
            self._wake_writer.clear()
            try:
                await self.commit()
            except OSError:  # logged; the same group is written again, never dropped
                self._wake_writer.set()
                await asyncio.sleep(retry)
                retry = min(retry * 2, 5.0)
            else:
                retry = 0.1

    async def commit(self) -> None:
        """Write and fsync everything queued, as one group."""
        if not self._queue:
            return
        # Lines put while this group is being written wait for the next one.
        batch, last, self._queue = self._queue, self._queued_seq, []
        callbacks, self._callbacks = self._callbacks, []
        first = last - len(batch) + 1
        self._writing = len(batch)
        try:
            await self.on_disk_thread(lambda: self._append(first, b"".join(batch)))
        except OSError as exc:  # disk full, read-only, EIO: the group waits in memory
            self._queue[:0] = batch
            self._callbacks[:0] = callbacks
            metrics.SPOOL_WRITE_ERRORS.inc()
            log.error("spool_write_failed", dir=str(self.dir), error=repr(exc),
                      events_in_memory=len(self._queue))
            if self.gate.set(True, exc.strerror or repr(exc)):
                log.error("spool_admission_closed", dir=str(self.dir), error=repr(exc),
                          events_in_memory=len(self._queue))
            raise
        finally:
            self._writing = 0
        if self.gate.closed and self.gate.set(False):
            log.info("spool_admission_reopened", dir=str(self.dir), events_written=len(batch))
        self._keep_recent(first, batch)
        self.durable_seq = last
        self.durable.set()
        for cb in callbacks:
            cb()
        waiting, self._waiters = self._waiters, []
        for seq, fut in waiting:
            if seq > last:
                self._waiters.append((seq, fut))
            elif not fut.done():
                fut.set_result(None)

    async def on_disk_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the spool's disk thread, after what was queued there before."""
        if self._disk is None:
            self._disk = DiskThread(f"spool-{self.instance_id}")
        return await self._disk.run(fn)

    def _keep_recent(self, first: int, lines: list[bytes]) -> None:
        recent = self._recent
        if recent and recent[-1][0] != first - 1:
            recent.clear()  # never a gap: what is kept is one run of seqs
        recent.extend(enumerate(lines, first))
        while recent and (len(recent) > RECENT_MAX or recent[0][0] <= self.delivered):
            recent.popleft()

    def _read_recent(self, want: int, limit: int) -> list[tuple[int, bytes]] | None:
        """Up to `limit` lines from seq `want` on, from memory (which holds every durable
        line after the first it holds); None when `want` is not there."""
        recent = self._recent
        while recent and recent[0][0] < want:
            recent.popleft()  # delivered (the shipper reads from delivered + 1, in order)
        if not recent or recent[0][0] != want:
            return None
        n = min(limit, len(recent))
        return [(seq, line[:-1]) for seq, line in itertools.islice(recent, n)]

    async def until_durable(self, seq: int) -> None:
        """Return once event `seq` is on disk (for a caller that must not acknowledge
        before: Envoy's record of a request is dropped once we answer its Export)."""
        if self.durable_seq >= seq:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        if self._lingering is not None:
            _resolve(self._lingering)  # commit now, not after the linger
        await fut

    # -- reading back and delivery marks -----------------------------------------------

    @property
    def in_memory(self) -> int:
        """Events not yet on disk: queued, or in the group commit being written (while the
        disk refuses, every event since the last good write, retried included)."""
        return len(self._queue) + self._writing

    @property
    def depth(self) -> int:
        """Events assigned but not yet delivered (queued, on disk, or in flight)."""
        return self.last_seq - self.delivered

    def read_batch(self, limit: int = 500) -> list[tuple[int, bytes]]:
        """Up to `limit` durable, undelivered lines, in seq order."""
        if self.delivered + 1 > self.durable_seq:
            return []
        if (kept := self._read_recent(self.delivered + 1, limit)) is not None:
            return kept
        return self._read_files(limit)

    async def next_batch(self, limit: int = 500) -> list[tuple[int, bytes]]:
        """`read_batch` for the shipper: what is not in memory is read from the files in a
        thread, off the event loop (a reader behind by a whole segment would stall the
        Checks for the read of up to 1 MB and the scan to its offset)."""
        if self.delivered + 1 > self.durable_seq:
            return []
        if (kept := self._read_recent(self.delivered + 1, limit)) is not None:
            return kept
        return await asyncio.to_thread(self._read_files, limit)

    def _read_files(self, limit: int) -> list[tuple[int, bytes]]:
        return self.files.read(self.delivered + 1, self.durable_seq, limit)

    @property
    def delivered_unpersisted(self) -> bool:
        return self._persisted != self.delivered

    def persist_delivered(self) -> None:
        if self._persisted == self.delivered:
            return
        tmp = self.dir / "delivered.tmp"
        tmp.write_text(str(self.delivered))
        os.replace(tmp, self.dir / "delivered")
        self.mark_written(self.delivered)

    def write_mark(self, delivered: int) -> None:
        """Write the delivered mark `delivered` (a value `delivered` held), from any thread:
        its own temporary file, so a concurrent persist_delivered cannot mix with it (the
        last rename wins; an older mark only means duplicates, never a loss)."""
        tmp = self.dir / "delivered.bg.tmp"
        tmp.write_text(str(delivered))
        os.replace(tmp, self.dir / "delivered")

    def mark_written(self, delivered: int) -> None:
        """`delivered` is on disk: segments wholly at or below it can go (event loop)."""
        self._persisted = delivered
        self.files.drop_through(delivered)

    def oldest_age(self, now: float) -> float:
        """Seconds the oldest undelivered event has waited (0 when none waits)."""
        while self._put_at and self._put_at[0][0] <= self.delivered:
            self._put_at.popleft()
        if self.delivered < self._recovered[0]:
            return max(0.0, now - self._recovered[1])
        return max(0.0, now - self._put_at[0][1]) if self._put_at else 0.0

    def mark_delivered(self, seq: int, persist: bool = True) -> None:
        """Record what the sink acknowledged. With persist=False only in memory: a crash
        then re-sends those events (duplicates are allowed; losses are not)."""
        self.delivered = seq
        if persist:
            self.persist_delivered()
