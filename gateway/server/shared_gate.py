"""The records processes' spool states, shared with the door processes
(GATEWAY_DOOR_WORKERS): a door has no spool, yet must refuse new requests while the spool
that would record them cannot write, as a single process does (gateway/server/workers.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.log import log
from gateway.sinks.gate import UsageGate
from gateway.tasks import watched


class SharedGate:
    """The records processes' spool states, shared with the door processes: `flags` holds
    one byte per records process (1: its spool cannot write), `index` is this process's
    (-1 in a door process). A records process writes its byte when its gate changes; a door
    process reads them all every POLL_S into its own gate, which its Checks read."""

    # A quarter second: an idle door wakes 4 times a second for it, not 20; the requests a
    # door admits in that time after a disk fills have their events kept in memory.
    POLL_S = 0.25

    def __init__(self, flags: Any, index: int) -> None:
        self.flags = flags  # multiprocessing.RawArray of unsigned bytes
        self.index = index

    def follow(self, gate: UsageGate, door: bool, tasks: list[asyncio.Task[None]]) -> None:
        if door:
            tasks.append(watched(self._poll(gate), "usage_gate_poll"))
        elif self.index >= 0:
            flags, i = self.flags, self.index
            flags[i] = 0  # a restarted records process starts writable (its spool opened)

            def write(closed: bool) -> None:
                flags[i] = 1 if closed else 0
            gate.listeners.append(write)

    async def _poll(self, gate: UsageGate) -> None:
        while True:
            closed = any(self.flags)
            if closed != gate.closed:
                gate.set(closed, "a records process's spool cannot write")
                (log.error if closed else log.info)(
                    "spool_admission_closed" if closed else "spool_admission_reopened",
                    door=True)
            await asyncio.sleep(self.POLL_S)
