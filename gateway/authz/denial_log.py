"""The denial log line, bounded: a 401 flood must not cost a JSON render and a stderr write
per Check (a syscall each, on the event loop every Check shares).

Each kind of denial (reason and key) is logged in full, request id included, for its first
PER_WINDOW occurrences in a WINDOW_S window; the rest are counted, and one `denials_summary`
line after the window says how many of each kind went unlogged, with a sample of their
request ids. The timer is armed only when something was held back, so an idle or quiet
sidecar never wakes for it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from gateway.authz.decision import Deny
from gateway.log import log

WINDOW_S = 1.0
PER_WINDOW = 5  # full lines per kind and window
SAMPLE = 10  # request ids of held-back denials in the summary line

_Kind = tuple[str, str]  # (reason, key_id)


class DenialLog:
    def __init__(self, window_s: float = WINDOW_S, per_window: int = PER_WINDOW,
                 logger: Any = log) -> None:
        self.log = logger  # structlog's; a test's recorder
        self.window_s = window_s
        self.per_window = per_window
        self._window_end = 0.0
        self._logged: Counter[_Kind] = Counter()  # full lines this window
        self._held: Counter[tuple[str, str, int, str]] = Counter()  # reason, key, status, tier
        self._sample: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def denied(self, request_id: str, deny: Deny) -> None:
        now = time.monotonic()
        if now >= self._window_end:
            self._window_end = now + self.window_s
            self._logged.clear()
        kind = (deny.reason, deny.key_id)
        if self._logged[kind] < self.per_window:
            self._logged[kind] += 1
            self.log.info("denied", request_id=request_id, key_id=deny.key_id or None,
                          status=deny.status, reason=deny.reason, tier=deny.tier)
            return
        self._held[(deny.reason, deny.key_id, deny.status, deny.tier or "")] += 1
        if len(self._sample) < SAMPLE:
            self._sample.append(request_id)
        if self._timer is None:  # at the window's end
            self._timer = asyncio.get_running_loop().call_later(
                self._window_end - now, self.summary)

    def summary(self) -> None:
        """One line for the denials held back since the last one."""
        self._timer = None
        if not self._held:
            return
        self.log.info("denials_summary", count=sum(self._held.values()),
                      kinds=[{"reason": reason, "key_id": key or None, "status": status,
                              "tier": tier or None, "count": n}
                             for (reason, key, status, tier), n in self._held.most_common()],
                      request_ids=self._sample)
        self._held.clear()
        self._sample = []
