"""The spool's delivery path when the filesystem fails under it: a full or read-only disk
while the delivered mark is written or the files are read back, a spool directory removed
while running, a dead instance's spool adopted and given back. The shipper must outlive
every failure, loudly, and deliver once the disk is back."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import metrics
from gateway.log import configure
from gateway.sinks.shipper import Shipper
from gateway.sinks.spool import Spool


def _put(sp: Spool, n: int) -> None:
    for _ in range(n):
        seq = sp.next_seq()
        sp.put(seq, orjson.dumps({"seq": str(seq), "event_id": f"e{seq}"}))


class _Sink:
    def __init__(self) -> None:
        self.got: list[bytes] = []

    async def send_batch(self, records: list[Any]) -> None:
        self.got += [r[0] for r in records]

    async def close(self) -> None:
        pass


async def _until(cond: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


async def test_the_shipper_outlives_a_full_disk_under_its_delivered_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """ENOSPC (or EROFS) on the delivered mark's write: delivery goes on from memory, the
    failure is logged and counted, and the mark is written once the disk has room."""
    configure("info", cache=False)
    sp = Spool(tmp_path, "i").open()
    real = Spool.write_mark
    full = [True]

    def write_mark(self: Spool, delivered: int) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, delivered)

    monkeypatch.setattr(Spool, "write_mark", write_mark)
    sink = _Sink()
    errors = metrics.SPOOL_WRITE_ERRORS._value.get()
    writer = asyncio.create_task(sp.run_writer(linger=0.0))
    shipper = asyncio.create_task(Shipper(sp, sink, linger=0.0, persist_every=0.02).run())
    try:
        _put(sp, 3)
        await _until(lambda: len(sink.got) == 3)
        await asyncio.sleep(0.1)  # several marks due, each failing
        _put(sp, 2)
        await _until(lambda: len(sink.got) == 5)
        assert not shipper.done(), shipper.exception()
        assert metrics.SPOOL_WRITE_ERRORS._value.get() > errors
        assert "spool_mark_write_failed" in capsys.readouterr().err
        full[0] = False  # space again: the mark reaches the disk
        await _until(lambda: (tmp_path / "i" / "delivered").exists()
                     and (tmp_path / "i" / "delivered").read_text() == "5")
    finally:
        writer.cancel()
        shipper.cancel()
        await asyncio.gather(writer, shipper, return_exceptions=True)
        sp.close()


async def test_the_shipper_outlives_a_failed_read_of_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The shipper behind (a restart): its read of the files fails (EIO), is logged, and
    is tried again; the events are delivered once it succeeds."""
    configure("info", cache=False)
    sp = Spool(tmp_path, "i").open()
    _put(sp, 4)
    await sp.commit()
    sp.close()
    sp = Spool(tmp_path, "i").open()  # nothing in memory: the shipper reads the file
    real = Spool._read_files
    fails = [1]

    def read_files(self: Spool, limit: int) -> list[tuple[int, bytes]]:
        if fails:
            fails.pop()
            raise OSError(errno.EIO, "Input/output error")
        return real(self, limit)

    monkeypatch.setattr(Spool, "_read_files", read_files)
    sink = _Sink()
    shipper = asyncio.create_task(Shipper(sp, sink, linger=0.0).run())
    try:
        await _until(lambda: len(sink.got) == 4 or shipper.done())
        assert not shipper.done(), shipper.exception()
        assert sink.got == [b"e1", b"e2", b"e3", b"e4"]
        assert "spool_read_failed" in capsys.readouterr().err
    finally:
        shipper.cancel()
        await asyncio.gather(shipper, return_exceptions=True)
        sp.close()


async def test_an_adopted_spool_is_given_back_once_delivered(tmp_path: Path) -> None:
    """A starting instance drains a dead one's spool; then its owner (the same pod name or
    worker, restarted) must be able to take it back, not find it locked until the adopter
    stops."""
    from gateway.errors import SpoolLocked
    from gateway.sinks.spools import orphans

    dead = Spool(tmp_path, "pod-a").open()
    _put(dead, 3)
    await dead.commit()
    dead.close()  # its process died
    [adopted] = orphans(tmp_path, "pod-b")
    with pytest.raises(SpoolLocked):  # while it drains, it is the adopter's
        Spool(tmp_path, "pod-a").open()
    sink = _Sink()
    await asyncio.wait_for(Shipper(adopted, sink).run(until_empty=True), 5)
    assert sink.got == [b"e1", b"e2", b"e3"]
    back = Spool(tmp_path, "pod-a").open()  # its owner, restarted
    assert (back.delivered, back.last_seq) == (3, 3)
    back.close()


@pytest.mark.parametrize("fd_open", [True, False])
async def test_a_spool_directory_deleted_while_running_is_made_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fd_open: bool) -> None:
    """`rm -rf` of the spool under a live instance: the lines written since went to a file
    without a name, reported durable (settled, Envoy's batch answered) and gone at the next
    start. The directory, its lock and the open segment come back, loudly; seq goes on."""
    from gateway.errors import SpoolLocked

    configure("info", cache=False)
    sp = Spool(tmp_path, "i").open()
    _put(sp, 3)
    await sp.commit()
    sp.mark_delivered(1)
    if not fd_open:
        sp.files.close()  # as after a failed write
    import shutil
    shutil.rmtree(tmp_path / "i")
    _put(sp, 2)
    await sp.commit()
    assert "spool_directory_recreated" in capsys.readouterr().err
    with pytest.raises(SpoolLocked):  # still this live instance's
        Spool(tmp_path, "i").open()
    _put(sp, 1)
    await sp.commit()
    sp.close()
    again = Spool(tmp_path, "i").open()
    assert again.last_seq == 6
    kept = [s for s, _ in again.read_batch()]
    # the open segment is whole again; a closed one lost with its directory is not made up
    assert kept == ([2, 3, 4, 5, 6] if fd_open else [4, 5, 6])
    for seq, line in again.read_batch():
        assert orjson.loads(line)["seq"] == str(seq)
    again.close()


def test_a_spool_that_cannot_be_written_is_refused_at_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk full (or a directory not writable) but for its existing LOCK: the start
    fails naming the directory (docs/operations.md), not the first event's group commit."""
    from gateway.errors import SpoolUnusable

    Spool(tmp_path, "i").open().close()  # LOCK and all exist from an earlier run

    def full(self: Spool, delivered: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Spool, "write_mark", full)
    with pytest.raises(SpoolUnusable, match=str(tmp_path / "i")):
        Spool(tmp_path, "i").open()
    monkeypatch.undo()
    Spool(tmp_path, "i").open().close()  # the lock was given back


async def test_a_stray_log_file_in_a_spool_is_not_a_segment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every starting instance opens every spool under the root (to adopt the dead ones):
    a `*.log` not named by a seq (an operator's copy) made each start fail with a
    ValueError."""
    from gateway.sinks.spools import orphans

    configure("info", cache=False)
    dead = Spool(tmp_path, "pod-a").open()
    _put(dead, 2)
    await dead.commit()
    dead.close()
    (tmp_path / "pod-a" / "notes.log").write_text("x\n")
    [adopted] = orphans(tmp_path, "pod-b")
    assert [s for s, _ in adopted.read_batch()] == [1, 2]
    adopted.close()
    assert "spool_file_ignored" in capsys.readouterr().err


async def test_a_directory_deleted_after_a_failed_roll_keeps_one_segment_per_seq(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group commit that failed as it began a new segment, then the directory deleted:
    the next commit starts that segment once, at its seq."""
    import os
    import shutil

    sp = Spool(tmp_path, "i", segment_bytes=10).open()
    _put(sp, 1)
    await sp.commit()
    real = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    _put(sp, 1)
    with pytest.raises(OSError):
        await sp.commit()  # segment 2 begun, nothing in it
    monkeypatch.setattr(os, "write", real)
    shutil.rmtree(tmp_path / "i")
    _put(sp, 1)
    await sp.commit()
    assert sp.files.firsts == sorted(set(sp.files.firsts))
    sp.close()
    again = Spool(tmp_path, "i", segment_bytes=10).open()
    assert [s for s, _ in again.read_batch()] == [2, 3]
    again.close()
