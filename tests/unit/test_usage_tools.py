"""`gateway usage tail`'s order and `usage reconcile`'s choice of spool directory."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.billing.commands import DEV_SPOOL, spool_dir
from gateway.billing.tail import last_in_time_order


def ev(ended: str, inst: str = "i1", seq: int = 1) -> bytes:
    return orjson.dumps({"ended_at": ended, "instance_id": inst, "seq": str(seq)})


def ends(raws: list[bytes]) -> list[str]:
    return [orjson.loads(r)["ended_at"] for r in raws]


# as Kafka hands them over: instance b's spool delivered late, partitions interleaved
ARRIVED = [ev("2026-12-01T10:00:03.000Z", "a", 3), ev("2026-12-01T10:00:01.000Z", "b", 1),
           ev("2026-12-01T10:00:04.000Z", "a", 4), ev("2026-12-01T10:00:02.000Z", "b", 2),
           ev("2026-12-01T09:59:59.500Z", "a", 2)]


def test_all_events_come_out_oldest_first() -> None:
    assert ends(last_in_time_order(ARRIVED, None)) == [
        "2026-12-01T09:59:59.500Z", "2026-12-01T10:00:01.000Z", "2026-12-01T10:00:02.000Z",
        "2026-12-01T10:00:03.000Z", "2026-12-01T10:00:04.000Z"]


@pytest.mark.parametrize(("n", "expect"), [
    (2, ["2026-12-01T10:00:03.000Z", "2026-12-01T10:00:04.000Z"]),  # the newest two, in order
    (0, []),
    (9, None),  # more than there are: all
])
def test_the_last_n_are_the_newest_by_time(n: int, expect: list[str] | None) -> None:
    got = ends(last_in_time_order(ARRIVED, n))
    assert got == (expect if expect is not None else ends(last_in_time_order(ARRIVED, None)))


def test_same_instant_sorts_by_instance_and_seq_and_garbage_is_kept() -> None:
    same = "2026-12-01T10:00:00.000Z"
    raws = [ev(same, "b", 1), b"not json", ev(same, "a", 10), ev(same, "a", 9)]
    assert last_in_time_order(raws, None) == [b"not json", ev(same, "a", 9), ev(same, "a", 10),
                                              ev(same, "b", 1)]


def test_a_spool_dir_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--spool-dir /nonexistent: no such directory"):
        spool_dir("/nonexistent", None, tmp_path)
    with pytest.raises(ValueError, match=r"\$GATEWAY_SPOOL_DIR /nonexistent: no such directory"):
        spool_dir(None, "/nonexistent", tmp_path)


def test_the_flag_wins_over_the_environment(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert spool_dir(str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "x") == tmp_path / "a"
    assert spool_dir(None, str(tmp_path / "b"), tmp_path / "x") == tmp_path / "b"


def test_by_default_the_serve_spool_else_gateway_devs(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    serve = Path(".gateway-spool")
    with pytest.raises(ValueError, match="no spool directory here"):
        spool_dir(None, None, serve)
    DEV_SPOOL.mkdir(parents=True)
    assert spool_dir(None, None, serve) == DEV_SPOOL  # what `gateway dev` writes
    serve.mkdir()
    assert spool_dir(None, None, serve) == serve


def test_reconcile_of_a_missing_spool_dir_exits_2_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    db = tmp_path / "usage.db"
    assert main(["usage", "reconcile", "--db", f"sqlite:///{db}",
                 "--spool-dir", "/nonexistent"]) == 2
    assert "--spool-dir /nonexistent: no such directory" in capsys.readouterr().err
    assert not db.exists()  # refused before anything was opened
