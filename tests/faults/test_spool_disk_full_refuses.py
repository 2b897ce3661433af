"""The spool's disk full while the sidecar runs, through the real stack (Envoy, sidecar,
mock engine, Redis; the spool on a tmpfs of its own, filled by a file): new requests are
refused with 503 `service_unavailable` ("usage cannot be recorded") and `retry-after`,
/readyz says not ready, the event of the request admitted before is kept (in memory), and
once the file is removed the next group commit admits requests again at once. Every request
then has exactly one event: the admitted ones theirs, each refused one its denial (503).
Also with GATEWAY_DOOR_WORKERS=1: the door process learns it from the records process."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from devspoke.stack import Spoke
from testkit.spoke import start_spoke

BODY = {"model": "mock-model", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
# (metering source, sidecar settings), in a fixed order
FLAVOURS: dict[str, tuple[str, dict[str, str]]] = {
    "envoy": ("envoy", {}),
    "ext_proc": ("ext_proc", {}),
    "envoy-door-workers": ("envoy", {"GATEWAY_DOOR_WORKERS": "1"}),
}


def _until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "spoke" / "spool"
    where.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(where: Path) -> Path:
    """A file that takes every free page of the filesystem."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 512)
    with pytest.raises(OSError) as exc, open(where / "probe", "wb", buffering=0) as f:
        f.write(b"\0" * 4096)
    assert exc.value.errno == errno.ENOSPC
    (where / "probe").unlink()
    return filler


def _post(spoke: Spoke, key: str, rid: str) -> httpx.Response:
    return httpx.post(f"{spoke.base_url}/chat/completions", json=BODY, timeout=10,
                      headers={"authorization": f"Bearer {key}", "x-request-id": rid})


def _ready(spoke: Spoke) -> tuple[int, str]:
    r = httpx.get(f"{spoke.metrics_url}/readyz", timeout=5)
    return r.status_code, r.text


def _events(spoke: Spoke) -> list[dict[str, Any]]:
    path = spoke.workdir / "usage.jsonl"
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_a_full_spool_disk_refuses_new_requests_and_loses_no_event(
        tmpfs: Path, tmp_path: Path, flavour: str) -> None:
    metering, env = FLAVOURS[flavour]
    spoke, keys = start_spoke(tmp_path / "spoke", metering=metering, kafka=False,
                              keep_request_ids=True, authz_http=True, sidecar_env=env)
    try:
        key = keys["good"]
        sent: dict[str, int] = {}  # request id -> the status the client saw

        def post() -> httpx.Response:
            rid = f"full-{uuid.uuid4()}"
            r = _post(spoke, key, rid)
            sent[rid] = r.status_code
            return r

        assert post().status_code == 200
        _until(lambda: len(_events(spoke)) == 1, 10, "the first event delivered")
        filler = _fill(tmpfs)
        # The next event cannot be written (a few may still fit in the open segment's last
        # page): requests are admitted until one's event fails, then refused.
        refused = _until(lambda: (r := post()).status_code == 503 and r, 10,
                         "a request refused while the spool's disk is full")
        assert all(code in (200, 503) for code in sent.values()), sent
        admitted_while_full = [rid for rid, code in sent.items() if code == 200][1:]
        body = refused.json()
        assert body["error"]["code"] == "service_unavailable", body
        assert body["error"]["type"] == "server_error", body
        assert "Usage cannot be recorded" in body["error"]["message"], body
        assert "spool not writable" in body["error"]["message"], body
        assert refused.headers.get("retry-after") == "1"
        for _ in range(3):
            assert post().status_code == 503
        _, text = _until(lambda: (s := _ready(spoke))[0] == 503 and s, 5,
                         "/readyz not ready")
        if not env:  # one process: its /readyz says why (the parent's only "not ready")
            assert "usage spool not writable" in text, text
        filler.unlink()  # space is back: the writer's next commit succeeds
        _until(lambda: _ready(spoke)[0] == 200, 10, "/readyz ready once space is back")
        assert post().status_code == 200
        want = set(sent)
        _until(lambda: want <= {e["event_id"] for e in _events(spoke)}, 15,
               "every request's event delivered")
        time.sleep(0.5)  # a duplicate would show
        mine = [e for e in _events(spoke) if e["event_id"] in want]
        ids = [e["event_id"] for e in mine]
        assert len(ids) == len(set(ids)) == len(want), "an event twice or missing"
        by_id = {e["event_id"]: e for e in mine}
        for rid, code in sent.items():
            assert by_id[rid]["status_code"] == code, (rid, code, by_id[rid])
            assert (by_id[rid]["outcome"] == "denied") == (code == 503), by_id[rid]
        for rid in admitted_while_full:  # kept in memory through the outage
            assert by_id[rid]["outcome"] != "denied"
    finally:
        spoke.stop()
        for f in ("filler", "probe"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmpfs / f)
