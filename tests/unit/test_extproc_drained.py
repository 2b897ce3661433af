"""A stopping sidecar waits for its ext_proc streams' handlers to finish (ExternalProcessor
Service.drained) before its spool's last commit: each emits its event in its `finally`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.server.extproc_service import ExternalProcessorService


class _Never:
    """A request iterator that never yields: the stream stays open until cancelled."""

    def __aiter__(self) -> _Never:
        return self

    async def __anext__(self) -> Any:
        await asyncio.Event().wait()


async def test_drained_waits_for_a_cancelled_handler_to_finish() -> None:
    svc = ExternalProcessorService(recorder=None, ledger=None)  # type: ignore[arg-type]
    gen: AsyncIterator[Any] = svc.Process(_Never(), context=None)  # type: ignore[arg-type]
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.01)
    assert svc.open == 1
    task.cancel()
    await asyncio.sleep(0)  # the cancellation delivered, its `finally` not yet run to the end
    t0 = time.monotonic()
    await svc.drained(2.0)
    assert svc.open == 0 and time.monotonic() - t0 < 1.0


async def test_drained_gives_up_after_its_time() -> None:
    svc = ExternalProcessorService(recorder=None, ledger=None)  # type: ignore[arg-type]
    gen: AsyncIterator[Any] = svc.Process(_Never(), context=None)  # type: ignore[arg-type]
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    await svc.drained(0.1)
    assert svc.open == 1 and 0.09 <= time.monotonic() - t0 < 1.0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
