"""While the spool cannot write (disk full, read-only, EIO) new requests are refused with
503 `service_unavailable` (fails closed: no request whose event could be lost), and admitted
again at the first group commit that succeeds. The state: the spool's gate, closed by a
failed commit, opened by the next good one; the Check reads it as a plain attribute; a door
process follows the records processes' flags in shared memory."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import multiprocessing as mp
from pathlib import Path

import orjson
import pytest

from gateway.authz.engine import AdmissionSettings, Authorizer
from gateway.authz.request import AuthzRequest
from gateway.log import configure
from gateway.server.shared_gate import SharedGate
from gateway.sinks.gate import UsageGate
from gateway.sinks.segments import Segments
from gateway.sinks.spool import Spool
from tests.unit.test_authz_engine import SECRETS, Gate, chat, denied, policy


def _put(sp: Spool, n: int) -> None:
    for _ in range(n):
        seq = sp.next_seq()
        sp.put(seq, orjson.dumps({"seq": str(seq), "event_id": f"e{seq}"}))


async def test_a_failed_commit_closes_the_gate_once_and_the_next_good_one_opens_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    configure("info", cache=False)
    gate = UsageGate()
    changes: list[bool] = []
    gate.listeners.append(changes.append)
    sp = Spool(tmp_path, "i", gate=gate).open()
    real, full = Segments.append, [True]

    def append(self: Segments, first: int, data: bytes) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, first, data)

    monkeypatch.setattr(Segments, "append", append)
    _put(sp, 2)
    for _ in range(3):  # the writer's retries: closed once, said once
        with pytest.raises(OSError):
            await sp.commit()
    assert gate.closed and gate.reason == "No space left on device" and changes == [True]
    err = capsys.readouterr().err
    assert err.count("spool_admission_closed") == 1 and err.count("spool_write_failed") == 3
    full[0] = False
    _put(sp, 1)  # an event of a request admitted before: kept, written with the rest
    await sp.commit()
    assert not gate.closed and gate.reason == "" and changes == [True, False]
    assert "spool_admission_reopened" in capsys.readouterr().err
    assert sp.durable_seq == 3
    sp.close()


async def test_a_closed_gate_refuses_new_requests_with_503_naming_the_caller() -> None:
    g = Gate(policy(key_limits="{rps: 100}"))
    usage = UsageGate()
    g.authz = Authorizer(g.authz._policy, g.limiter, g.clock, AdmissionSettings(),
                         ledger=g.ledger, gate=usage)
    usage.set(True, "No space left on device")
    d = denied(await g.check(chat(stream=True)), 503, "service_unavailable")
    assert d.reason == "spool_unwritable" and d.headers == {"retry-after": "1"}
    assert "Usage cannot be recorded" in d.message and "spool not writable" in d.message
    assert "No space left on device" in d.message
    assert (d.key_id, d.team, d.model, d.stream) == ("alice", "team-a", "qwen3-coder", True)
    assert g.limiter.calls == 0 and g.ledger.stage("req-1") is None  # nothing admitted
    # Anthropic's route: Anthropic's shape, as every denial there
    m = await g.check({"model": "qwen3-coder", "max_tokens": 5, "messages": []},
                      path="/v1/messages")
    assert denied(m, 503, "service_unavailable").api.name == "ANTHROPIC"
    usage.set(False)
    assert not isinstance(await g.check(chat()), type(d))  # admitted again at once


async def test_an_unknown_key_is_still_a_401_while_the_gate_is_closed() -> None:
    g = Gate(policy())
    usage = UsageGate()
    g.authz = Authorizer(g.authz._policy, g.limiter, g.clock, AdmissionSettings(),
                         ledger=g.ledger, gate=usage)
    usage.set(True, "Read-only file system")
    denied(await g.authz.check(AuthzRequest("r", "POST", "/v1/chat/completions", {
        "authorization": f"Bearer {SECRETS['alice']}x"}, b"{}")), 401, "invalid_api_key")


async def test_a_door_process_follows_the_records_processes_flags() -> None:
    flags = mp.get_context("spawn").RawArray(ctypes.c_ubyte, 2)
    records, door = UsageGate(), UsageGate()
    tasks: list[asyncio.Task[None]] = []
    SharedGate(flags, 1).follow(records, False, tasks)
    SharedGate(flags, -1).follow(door, True, tasks)
    try:
        records.set(True, "No space left on device")
        assert list(flags) == [0, 1]
        async with asyncio.timeout(2):
            while not door.closed:
                await asyncio.sleep(0.01)
        assert "records process" in door.reason
        records.set(False)
        async with asyncio.timeout(2):
            while door.closed:
                await asyncio.sleep(0.01)
    finally:
        for t in tasks:
            t.cancel()
