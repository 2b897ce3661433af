"""A spool's segment files: JSON lines in seq order, each file named by its first seq.

A line's seq is its position (the file's first seq plus its index): nothing is parsed to
find one, so a line that cannot be parsed still has its place. This is the spool's file
layer alone (`spool.py` keeps the queue, the group commit and the marks): appends run on
the spool's disk thread, reads in a worker thread, never two of a kind at once.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gateway.log import log


def name(first_seq: int) -> str:
    return f"{first_seq:020d}.log"


class Segments:
    def __init__(self, directory: Path, segment_bytes: int) -> None:
        self.dir = directory
        self.segment_bytes = segment_bytes
        self.firsts: list[int] = []  # first seq of each segment, ascending
        self._size = 0  # of the last segment
        # The last segment stays open for appends: a group commit is then one write and one
        # fsync, not also an open and a close (its path's lookup) each time.
        self._fd: int | None = None
        self._fd_first = 0
        self._cursor: tuple[int, int, int] | None = None  # (segment first seq, offset, seq)

    def path(self, first: int) -> Path:
        return self.dir / name(first)

    def recover(self, repair: bool) -> tuple[list[bytes], float] | None:
        """The files on disk: the last segment's complete lines and its last write (wall
        clock), None without a segment. A torn last line (a crash mid-write) is cut, with
        `repair` (a reader without the lock must not cut a live writer's file)."""
        self.firsts = []
        for p in self.dir.glob("*.log"):
            if p.stem.isdigit() and p.stem.isascii():
                self.firsts.append(int(p.stem))
            else:  # not a segment (a copy, a stray file): left alone, and said so
                log.warning("spool_file_ignored", path=str(p))
        self.firsts.sort()
        if not self.firsts:
            return None
        path = self.path(self.firsts[-1])
        data = path.read_bytes()
        good = data[: data.rfind(b"\n") + 1]
        if repair and len(good) != len(data):
            log.warning("spool_torn_line_cut", path=str(path), offset=len(good),
                        bytes=len(data) - len(good))
            with open(path, "r+b") as f:
                f.truncate(len(good))
        self._size = len(good)
        return good.splitlines(), path.stat().st_mtime

    def append(self, first: int, data: bytes) -> None:
        """Write and fsync `data`, whose first line is seq `first` (a new segment once the
        last one is full). On an error no part of it stays: the next append (this one
        again) must not be glued onto a torn line."""
        if not self.firsts or self._size >= self.segment_bytes:
            if not self.firsts or self.firsts[-1] != first:  # else begun by a failed one
                self.firsts.append(first)
            self._size = 0
        fd = self._open(self.firsts[-1])
        try:
            written = os.write(fd, data)
            while written < len(data):  # a short write (the disk filling up): the rest
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._size)
            self.close()  # reopened by the next append
            raise
        self._size += len(data)

    def _open(self, first: int) -> int:
        """The open append fd of segment `first` (the last one), opening it on a change
        (read too: `relink` copies it from there once its name is gone)."""
        if self._fd is None or self._fd_first != first:
            self.close()
            self._fd = os.open(self.path(first), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            self._fd_first = first
        return self._fd

    def removed(self) -> bool:
        """Whether the open segment lost its name (its directory deleted): what is
        written to it would reach no file a restart reads."""
        if self._fd is not None:
            return os.fstat(self._fd).st_nlink == 0
        return not self.dir.is_dir()

    def relink(self) -> int:
        """Give the open segment its name back in a recreated directory, with all it holds
        (read from its fd), fsynced; how many segments are gone for good (closed ones)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lost = sum(1 for f in self.firsts[:-1] if not self.path(f).exists())
        if self._fd is not None:
            data = os.pread(self._fd, self._size, 0)
            path = self.path(self._fd_first)
            tmp = path.with_suffix(".relink")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            try:
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fsync(fd)
                os.replace(tmp, path)
            except OSError:
                os.close(fd)
                raise
            self.close()
            self._fd = fd
        elif self.firsts and not self.path(self.firsts[-1]).exists():
            self._size = self.segment_bytes  # the next append starts a segment at its seq
            lost += 1
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return lost

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def read(self, want: int, through: int, limit: int) -> list[tuple[int, bytes]]:
        """Up to `limit` lines from seq `want` to `through`, as (seq, line without its
        newline); a reader that goes on where the last read stopped seeks nothing."""
        out: list[tuple[int, bytes]] = []
        seg, offset, seq = self._seek(want)
        while len(out) < limit and seq <= through:
            with open(self.path(seg), "rb") as f:
                f.seek(offset)
                data = f.read(1 << 20)
            progressed = False
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n") or seq > through or len(out) >= limit:
                    break
                out.append((seq, line[:-1]))
                offset += len(line)
                seq += 1
                progressed = True
            if not progressed:  # the end of this segment: the next one starts at `seq`
                nxt = next((s for s in self.firsts if s > seg), None)
                if nxt != seq:
                    break
                seg, offset = nxt, 0
        self._cursor = (seg, offset, seq)
        return out

    def _seek(self, want: int) -> tuple[int, int, int]:
        if self._cursor and self._cursor[2] == want:
            return self._cursor
        seg = max(s for s in self.firsts if s <= want)
        offset, seq = 0, seg
        with open(self.path(seg), "rb") as f:
            for line in f:
                if seq == want:
                    break
                offset += len(line)
                seq += 1
        return seg, offset, seq

    def drop_through(self, seq: int) -> None:
        """Remove the segments wholly at or below `seq` (the next one starts at or below
        seq + 1); the last one always stays."""
        while len(self.firsts) > 1 and self.firsts[1] <= seq + 1:
            try:
                self.path(self.firsts[0]).unlink(missing_ok=True)
            except OSError as exc:  # read-only: it stays (its events are delivered)
                log.warning("spool_segment_not_removed", path=str(self.path(self.firsts[0])),
                            error=repr(exc))
                return  # tried again with the next mark
            self.firsts.pop(0)
