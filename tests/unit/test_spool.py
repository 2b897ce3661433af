"""The usage spool on a real filesystem: order, group commit, recovery, adoption."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.sinks.spool import Spool, SpoolLocked
from gateway.sinks.spools import choose_instance, orphans, spooled


def _put(sp: Spool, n: int) -> None:
    for _ in range(n):
        seq = sp.next_seq()
        sp.put(seq, orjson.dumps({"seq": str(seq), "event_id": f"e{seq}"}))


def _seqs(lines: list[tuple[int, bytes]]) -> list[int]:
    for seq, line in lines:  # the position and the line's own seq always agree
        assert int(orjson.loads(line)["seq"]) == seq
    return [s for s, _ in lines]


async def test_puts_during_a_group_commit_keep_their_order(tmp_path: Path) -> None:
    sp = Spool(tmp_path, "i").open()
    writer = asyncio.create_task(sp.run_writer())
    for _ in range(50):  # interleave puts with commits in flight
        _put(sp, 7)
        await asyncio.sleep(0)
    while sp.durable_seq < 350:
        await asyncio.sleep(0.01)
    writer.cancel()
    assert _seqs(sp.read_batch(1000)) == list(range(1, 351))


async def test_recovery_continues_seq_and_cuts_a_torn_line(tmp_path: Path) -> None:
    sp = Spool(tmp_path, "i").open()
    _put(sp, 5)
    await sp.commit()
    sp.mark_delivered(2)
    sp.close()
    seg = next((tmp_path / "i").glob("*.log"))
    with open(seg, "ab") as f:
        f.write(b'{"seq": "6", "event_')  # the crash came mid-write
    again = Spool(tmp_path, "i").open()
    assert (again.last_seq, again.delivered, again.depth) == (5, 2, 3)
    assert _seqs(again.read_batch()) == [3, 4, 5]
    _put(again, 1)
    await again.commit()
    assert _seqs(again.read_batch()) == [3, 4, 5, 6]


async def test_delivered_segments_are_removed(tmp_path: Path) -> None:
    sp = Spool(tmp_path, "i", segment_bytes=100).open()
    for _ in range(6):
        _put(sp, 3)
        await sp.commit()
    assert len(list(sp.dir.glob("*.log"))) > 2
    batch = sp.read_batch(100)
    assert _seqs(batch) == list(range(1, 19))
    sp.mark_delivered(18)
    assert len(list(sp.dir.glob("*.log"))) == 1  # only the one being written
    assert sp.read_batch() == []


async def test_a_live_spool_is_locked_and_a_dead_one_is_adopted(tmp_path: Path) -> None:
    live = Spool(tmp_path, "host-1").open()
    with pytest.raises(SpoolLocked):
        Spool(tmp_path, "host-1").open()
    dead = Spool(tmp_path, "host-2").open()
    _put(dead, 4)
    await dead.commit()
    dead.close()  # its process died
    adopted = orphans(tmp_path, "host-3")
    assert [s.instance_id for s in adopted] == ["host-2"]
    assert _seqs(adopted[0].read_batch()) == [1, 2, 3, 4]
    assert spooled(tmp_path)["host-2"] == (1, 4)
    live.close()


def test_an_unconfigured_instance_reuses_this_hosts_spool(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "box")
    Spool(tmp_path, "box-123").open().close()
    assert choose_instance(tmp_path, "") == "box-123"  # seq continues after a restart
    assert choose_instance(tmp_path, "explicit") == "explicit"
    held = Spool(tmp_path, "box-123").open()
    assert choose_instance(tmp_path, "").startswith("box-")
    assert choose_instance(tmp_path, "") != "box-123"
    held.close()


async def test_until_durable_returns_once_the_event_is_on_disk(tmp_path: Path) -> None:
    """What the Envoy records service waits for before it acknowledges a batch."""
    sp = Spool(tmp_path, "i").open()
    _put(sp, 3)
    waiter = asyncio.create_task(sp.until_durable(3))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # queued, not yet written
    await sp.commit()
    await asyncio.wait_for(waiter, 1)
    await sp.until_durable(2)  # already durable: returns at once
    sp.close()


async def test_lines_someone_waits_on_skip_the_linger_and_the_rest_keep_it(
        tmp_path: Path) -> None:
    """A batch of Envoy's records came as one group: its answer must not wait `linger`
    for company. Lines nobody waits on (ext_proc's events) still linger for company."""
    sp = Spool(tmp_path, "i").open()
    writer = asyncio.create_task(sp.run_writer(linger=30.0))
    _put(sp, 3)
    await asyncio.sleep(0.2)
    assert sp.durable_seq == 0  # nobody waits: lingering
    _put(sp, 2)
    await asyncio.wait_for(sp.until_durable(5), 0.5)  # written without the 30 s linger?
    writer.cancel()
    sp.close()


async def test_the_oldest_undelivered_events_age(tmp_path: Path) -> None:
    """What /metrics shows as gateway_usage_spool_oldest_age_seconds (alert on it)."""
    sp = Spool(tmp_path, "i").open()
    assert sp.oldest_age(time.time()) == 0
    _put(sp, 2)
    await sp.commit()
    now = time.time()
    assert 0 <= sp.oldest_age(now + 5) - 5 < 1
    sp.mark_delivered(2)
    assert sp.oldest_age(now + 5) == 0
    _put(sp, 1)
    await sp.commit()
    sp.close()
    again = Spool(tmp_path, "i").open()  # recovered from disk: counted from the segment's write
    assert again.depth == 1 and again.oldest_age(time.time() + 30) >= 29
    again.close()


class _Sink:
    def __init__(self) -> None:
        self.sent = 0

    async def send_batch(self, records: list[Any]) -> None:
        self.sent += len(records)

    async def close(self) -> None:
        return None


async def test_the_delivered_mark_is_written_at_most_and_at_latest_every_persist_every(
        tmp_path: Path) -> None:
    """Not once per drained batch (a write and a rename each): at most every persist_every,
    and, when no more events come, that long after the last delivery."""
    from gateway.sinks.shipper import Shipper

    sp = Spool(tmp_path, "i").open()
    writer = asyncio.create_task(sp.run_writer())
    sink = _Sink()
    shipper = asyncio.create_task(Shipper(sp, sink, linger=0.0, persist_every=0.3).run())
    mark = sp.dir / "delivered"
    writes = 0
    last = None
    t0 = time.monotonic()
    for _ in range(20):  # 20 small batches, each drained at once
        _put(sp, 1)
        await asyncio.sleep(0.01)
        now = mark.read_text() if mark.exists() else None
        writes += now != last
        last = now
    took = time.monotonic() - t0
    assert writes <= 1 + took / 0.3, (writes, took)  # not 20: one per persist_every
    for _ in range(100):
        if sink.sent == 20:
            break
        await asyncio.sleep(0.01)
    assert sink.sent == 20
    await asyncio.sleep(0.5)  # idle: the last delivery still reaches the disk
    assert mark.read_text() == "20"
    shipper.cancel()
    writer.cancel()


def _open_segments(spool_dir: Path) -> list[str]:
    """The segment files this process holds open (its fds' targets, by name)."""
    names = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:
            continue
        if target.parent == spool_dir and target.suffix == ".log":
            names.append(target.name)
    return names


async def test_group_commits_append_through_one_open_segment(tmp_path: Path) -> None:
    """The last segment stays open across group commits; a rotation closes the old one, and
    close() the last: no fd per commit, none leaked."""
    sp = Spool(tmp_path, "i", segment_bytes=200).open()
    for _ in range(8):
        _put(sp, 2)
        await sp.commit()
        assert _open_segments(tmp_path / "i") == [f"{sp.files.firsts[-1]:020d}.log"]
    assert len(sp.files.firsts) > 1  # rotated at least once
    assert _seqs(sp.read_batch(100)) == list(range(1, 17))
    sp.close()
    assert _open_segments(tmp_path / "i") == []


async def test_the_shipper_reads_what_it_just_wrote_from_memory_else_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines just made durable come back without reading the file; a reader further behind
    than RECENT_MAX (the sink away) gets the same lines from the file."""
    from gateway.sinks import spool as spool_module
    monkeypatch.setattr(spool_module, "RECENT_MAX", 5)
    sp = Spool(tmp_path, "i").open()
    for _ in range(4):
        _put(sp, 3)
        await sp.commit()
    assert _seqs(sp.read_batch(100)) == list(range(1, 13))  # 1..7 only on disk
    sp.mark_delivered(7, persist=False)
    [segment] = (tmp_path / "i").glob("*.log")
    on_disk = segment.read_bytes().splitlines()
    segment.unlink()  # from here on, a read of the file would fail
    assert sp.read_batch(100) == [(s, on_disk[s - 1]) for s in range(8, 13)]
    assert _seqs(sp.read_batch(2)) == [8, 9]


async def test_the_shippers_file_reads_run_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """next_batch: lines in memory at once, lines only on disk read in a thread (the same
    lines read_batch gives)."""
    from gateway.sinks import spool as spool_module
    monkeypatch.setattr(spool_module, "RECENT_MAX", 5)
    sp = Spool(tmp_path, "i").open()
    for _ in range(4):
        _put(sp, 3)
        await sp.commit()
    loop_thread, readers = threading.get_ident(), []
    read_files = sp._read_files

    def spy(limit: int) -> list[tuple[int, bytes]]:
        readers.append(threading.get_ident())
        return read_files(limit)

    monkeypatch.setattr(sp, "_read_files", spy)
    assert _seqs(await sp.next_batch(100)) == list(range(1, 13))  # 1..7 only on disk
    assert readers and loop_thread not in readers
    sp.mark_delivered(7, persist=False)
    readers.clear()
    assert _seqs(await sp.next_batch(100)) == list(range(8, 13))  # from memory
    assert readers == []
    sp.close()


async def test_a_mark_written_off_the_loop_drops_only_segments_below_it(tmp_path: Path) -> None:
    """The shipper writes the delivered mark in a thread while deliveries go on: the
    segments dropped are those below the mark on disk, not below what is delivered by
    then, so a restart finds every event after its mark."""
    sp = Spool(tmp_path, "i", segment_bytes=100).open()
    for _ in range(6):
        _put(sp, 3)
        await sp.commit()
    sp.mark_delivered(6, persist=False)
    await asyncio.to_thread(sp.write_mark, 6)
    sp.mark_delivered(18, persist=False)  # delivered on while the mark was being written
    sp.mark_written(6)
    assert sp.delivered_unpersisted
    sp.files.close()
    assert sp._lock_fd is not None
    os.close(sp._lock_fd)  # a crash: nothing more reaches the disk
    again = Spool(tmp_path, "i").open()
    assert (again.delivered, again.last_seq) == (6, 18)
    assert _seqs(again.read_batch(100)) == list(range(7, 19))
