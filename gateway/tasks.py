"""Stopping background tasks for certain.

redis-py 8.1's asyncio client can swallow a cancellation that lands inside a command: the
command returns normally and the task goes on (measured: 368 of 3,000 HGETs cancelled at a
random moment returned a value, their task still `cancelling()`). One `cancel()` may then
never end a loop that calls Redis, and a `stop()` that awaits it hangs (a SIGTERMed sidecar
that does not exit). So: cancel again until every task has ended.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine, Iterable
from typing import Any

from gateway.log import log

RETRY_S = 0.05  # how long a cancelled task has to end before it is cancelled again


async def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and return once every one has ended (their exceptions retrieved)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RETRY_S)
    await asyncio.gather(*tasks, return_exceptions=True)


def watched(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """A background task (a loop meant to run until stopped) whose crash is logged at once
    (`background_task_crashed`), not when the task is collected: a loop that died silently
    left, e.g., the limiter store's gauge and health stuck at their last values."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    task.add_done_callback(_crashed)
    return task


def _crashed(task: asyncio.Task[Any]) -> None:
    if task.cancelled() or (exc := task.exception()) is None:
        return
    log.error("background_task_crashed", task=task.get_name(), error=repr(exc),
              exc_info=exc)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C): a long-running command ends its work
    between steps, with no KeyboardInterrupt traceback. Call it in the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
