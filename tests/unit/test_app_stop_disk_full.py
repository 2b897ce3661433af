"""A stop on a full disk still stops everything: the last group commit failing (logged by
the spool with the events it keeps in memory) must not skip the ledger's flush, the
spool's close (its lock) or the policy sync's stop."""

from __future__ import annotations

import asyncio
import errno

from gateway.server.app import App
from gateway.server.usage_pipeline import UsagePipeline
from gateway.settings import Settings


class _FullSpool:
    closed = False
    delivered = durable_seq = 0

    async def commit(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self.closed = True


class _Producer:
    async def close(self) -> None:
        pass


class _Stops:
    stopped = False

    async def stop(self) -> None:
        self.stopped = True


def test_a_stop_whose_last_commit_fails_still_flushes_closes_and_stops() -> None:
    spool, ledger, sync = _FullSpool(), _Stops(), _Stops()
    usage = UsagePipeline(spool, [spool], _Producer())  # type: ignore[list-item,arg-type]
    app = App(Settings(), "i-1", usage=usage, ledger=ledger, sync=sync)  # type: ignore[arg-type]
    asyncio.run(app.stop(0))
    assert ledger.stopped and spool.closed and sync.stopped
