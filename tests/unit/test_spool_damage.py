"""The usage spool when its disk fails it: a torn or corrupt line, a bad delivered mark, a
full disk. Nothing is dropped without a log, nothing is glued, no loop stalls."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.log import configure
from gateway.sinks.shipper import Shipper
from gateway.sinks.spool import Spool


def _put(sp: Spool, n: int) -> None:
    for _ in range(n):
        seq = sp.next_seq()
        sp.put(seq, orjson.dumps({"seq": str(seq), "event_id": f"e{seq}"}))


def _seqs(lines: list[tuple[int, bytes]]) -> list[int]:
    for seq, line in lines:  # the position and the line's own seq agree
        assert int(orjson.loads(line)["seq"]) == seq
    return [s for s, _ in lines]


def _flip(seg: Path, seq: int) -> None:
    data = bytearray(seg.read_bytes())
    data[data.index(b'{"seq":"%d"' % seq) + 1] = 0xFF  # invalid UTF-8, invalid JSON
    seg.write_bytes(bytes(data))


async def test_a_corrupt_last_line_keeps_its_seq_and_the_next_event_its_own(
        tmp_path: Path) -> None:
    """A complete line that does not parse is an event's line: cutting it lost the event
    and put the next event's line at its position (read back as the wrong seq)."""
    sp = Spool(tmp_path, "i").open()
    _put(sp, 5)
    await sp.commit()
    sp.mark_delivered(5)
    sp.close()
    _flip(next((tmp_path / "i").glob("*.log")), 5)
    again = Spool(tmp_path, "i").open()
    assert (again.last_seq, again.depth) == (5, 0)
    _put(again, 2)
    await again.commit()
    again.close()
    third = Spool(tmp_path, "i").open()
    assert _seqs(third.read_batch()) == [6, 7]


class _Sink:
    def __init__(self) -> None:
        self.records: list[Any] = []

    async def send_batch(self, records: list[Any]) -> None:
        self.records.extend(records)

    async def close(self) -> None:
        return None


async def test_an_unreadable_line_is_sent_on_and_logged_not_retried_forever(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sp = Spool(tmp_path, "i").open()
    _put(sp, 5)
    await sp.commit()
    sp.close()
    _flip(next((tmp_path / "i").glob("*.log")), 3)
    again = Spool(tmp_path, "i").open()
    sink = _Sink()
    configure("info", cache=False)  # stderr, as the services log, whatever ran before here
    await asyncio.wait_for(Shipper(again, sink).run(until_empty=True), 5)
    assert [k for k, _, _ in sink.records] == [b"e1", b"e2", b"i:3", b"e4", b"e5"]
    assert again.delivered == 5
    assert "spool_line_unreadable" in capsys.readouterr().err


@pytest.mark.parametrize("mark", [None, "", "garbage", "999"])
async def test_a_missing_garbage_or_impossible_mark_sends_what_the_files_hold(
        tmp_path: Path, mark: str | None) -> None:
    """At-least-once: everything on disk is sent again; nothing is skipped, no crash (the
    first segments are gone: they were delivered)."""
    sp = Spool(tmp_path, "i", segment_bytes=100).open()
    for _ in range(6):
        _put(sp, 3)
        await sp.commit()
    sp.mark_delivered(9)
    first = sp.files.firsts[0]
    assert first > 1
    sp.close()
    path = tmp_path / "i" / "delivered"
    if mark is None:
        path.unlink()
    else:
        path.write_text(mark)
    again = Spool(tmp_path, "i", segment_bytes=100).open()
    assert (again.delivered, again.last_seq) == (first - 1, 18)
    assert _seqs(again.read_batch(100)) == list(range(first, 19))


async def test_a_full_disk_tears_no_line_and_loses_no_event(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short write is completed; a failed one is cut back, kept in memory and written
    again by the next commit (not glued onto a torn line, not dropped)."""
    sp = Spool(tmp_path, "i").open()
    _put(sp, 2)
    await sp.commit()
    real = os.write

    def short(fd: int, data: bytes) -> int:
        return real(fd, data[:7])

    monkeypatch.setattr(os, "write", short)
    _put(sp, 2)
    await sp.commit()

    def full(fd: int, data: bytes) -> int:
        real(fd, data[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    _put(sp, 2)
    with pytest.raises(OSError):
        await sp.commit()
    assert sp.durable_seq == 4
    monkeypatch.setattr(os, "write", real)
    _put(sp, 1)
    await sp.commit()
    sp.close()
    again = Spool(tmp_path, "i").open()
    assert _seqs(again.read_batch()) == [1, 2, 3, 4, 5, 6, 7]


async def test_the_writer_outlives_a_failed_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sp = Spool(tmp_path, "i").open()
    real = os.fsync
    fails = [1]

    def fsync(fd: int) -> None:
        if fails:
            fails.pop()
            raise OSError(errno.EIO, "I/O error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    writer = asyncio.create_task(sp.run_writer(linger=0.0))
    _put(sp, 3)
    await asyncio.wait_for(sp.until_durable(3), 5)
    writer.cancel()
    sp.close()
    assert _seqs(Spool(tmp_path, "i").open().read_batch()) == [1, 2, 3]


async def test_the_read_only_listing_cuts_nothing(tmp_path: Path) -> None:
    """`spooled` reads a live instance's spool without its lock: a line being written is
    not a torn line to cut."""
    from gateway.sinks.spools import spooled

    sp = Spool(tmp_path, "i").open()
    _put(sp, 2)
    await sp.commit()
    seg = next((tmp_path / "i").glob("*.log"))
    with open(seg, "ab") as f:
        f.write(b'{"seq":"3","ev')  # the owner's write, half done
    size = seg.stat().st_size
    assert spooled(tmp_path) == {"i": (1, 2)}
    assert seg.stat().st_size == size
    sp.close()
