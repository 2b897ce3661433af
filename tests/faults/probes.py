"""What the fault tests poll: one request's status and time, a gauge of the sidecar's
/metrics, and a condition waited for with a deadline (instead of a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from devspoke.stack import Spoke
from testkit.load import Load

Spk = tuple[Spoke, dict[str, str]]


def status(spoke: Spoke, key: str) -> tuple[int, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{spoke.base_url}/chat/completions", timeout=10,
                   headers={"authorization": f"Bearer {key}"},
                   json={"model": "mock-model", "messages": [], "max_tokens": 1})
    return r.status_code, time.monotonic() - t0


def gauge(spoke: Spoke, name: str) -> float:
    text = httpx.get(f"{spoke.metrics_url}/metrics", timeout=5).text
    return float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1])


def until(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.05)


def served(load: Load, n: int = 25, timeout: float = 15) -> None:
    """The load is under way: `n` of its requests served (what a fixed warm-up waited for)."""
    until(lambda: sum(r.status == 200 for r in list(load.results)) >= n, timeout,
          f"{n} requests served before the fault")


def serving_again(load: Load, since: int, n: int = 8, timeout: float = 20) -> None:
    """Recovered: the last `n` answers, all ended after result number `since`, are 200."""
    def ok() -> bool:
        tail = list(load.results)[since:][-n:]
        return len(tail) == n and all(r.status == 200 for r in tail)
    until(ok, timeout, f"{n} answers in a row served after the recovery")
