"""The denial log line is bounded under a flood, and what it holds back is summarised."""

from __future__ import annotations

import asyncio
from typing import Any

from structlog.testing import CapturingLogger

from gateway.authz import answers
from gateway.authz.denial_log import DenialLog


def lines(logger: CapturingLogger) -> list[dict[str, Any]]:
    """The log lines written, each as its event name and fields."""
    return [{"event": c.args[0], **c.kwargs} for c in logger.calls]


async def test_a_flood_logs_a_few_lines_then_one_summary() -> None:
    logger = CapturingLogger()
    denials = DenialLog(window_s=0.05, per_window=2, logger=logger)
    deny = answers.unauthorized()
    for i in range(10):
        denials.denied(f"r-{i}", deny)
    assert [e["request_id"] for e in lines(logger) if e["event"] == "denied"] == ["r-0", "r-1"]
    await asyncio.sleep(0.1)
    logs = lines(logger)
    [summary] = [e for e in logs if e["event"] == "denials_summary"]
    assert summary["count"] == 8 and summary["request_ids"] == [f"r-{i}" for i in range(2, 10)]
    assert summary["kinds"] == [{"reason": deny.reason, "key_id": None, "status": 401,
                                 "tier": None, "count": 8}]


async def test_each_kind_has_its_own_lines_and_a_new_window_logs_again() -> None:
    logger = CapturingLogger()
    denials = DenialLog(window_s=0.05, per_window=1, logger=logger)
    denials.denied("a", answers.unauthorized())
    denials.denied("b", answers.bad_request("no"))
    denials.denied("c", answers.unauthorized())  # held back
    await asyncio.sleep(0.1)
    denials.denied("d", answers.unauthorized())  # a new window
    logs = lines(logger)
    assert [e.get("request_id") for e in logs] == ["a", "b", None, "d"]
    assert logs[2]["event"] == "denials_summary" and logs[2]["request_ids"] == ["c"]


async def test_nothing_held_back_arms_no_timer() -> None:
    denials = DenialLog()
    denials.denied("a", answers.unauthorized())
    assert denials._timer is None
