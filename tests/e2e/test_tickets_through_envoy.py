"""Admitting ahead through a real Envoy (GATEWAY_ADMIT_AHEAD_MS, docs/admit-ahead.md): requests
answered from tickets get exactly one event each, and once they are settled Redis holds
what it would without tickets (every slot free, the day's counter the tokens billed). A key
with small limits never takes a ticket."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from devspoke.stack import Spoke
from gateway.settings import METERING_SOURCES
from testkit.spoke import client, read_events, start_spoke

MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture(params=METERING_SOURCES)
def ahead_spoke(request: pytest.FixtureRequest,
                tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = start_spoke(tmp_path / "spoke", metering=request.param,
                              sidecar_env={"GATEWAY_ADMIT_AHEAD_MS": "250"})
    yield spoke, keys
    spoke.stop()


def tickets(spoke: Spoke, result: str) -> float:
    text = httpx.get(f"{spoke.metrics_url}/metrics").text
    m = re.search(rf'^gateway_admission_tickets_total{{result="{result}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _rid(raw: Any) -> str:
    return str(raw.headers["x-request-id"])


def test_requests_answered_from_tickets_are_metered_once_and_settled_exactly(
        ahead_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = ahead_spoke
    chat = client(spoke, keys["bench"]).chat.completions.with_raw_response
    rids = [_rid(chat.create(model="mock-model", messages=MSG, max_tokens=3))
            for _ in range(30)]
    assert len(set(rids)) == 30
    assert tickets(spoke, "taken") >= 10  # most found a ticket (one a request at most)
    events = read_events(spoke.kafka_bootstrap, set(rids))
    assert sorted(e["event_id"] for e in events) == sorted(rids)  # one each, no duplicate
    assert {e["outcome"] for e in events} == {"completed"}
    billed = sum(int(e["usage"]["total_tokens"]) for e in events)

    r = redis.Redis.from_url(spoke.redis_url)
    deadline = time.monotonic() + 15  # settled, and the last ticket expired unused
    while r.zcard("gw:reqs") or r.zcard("gw:conc:key:bench") or r.keys("gw:req:*"):
        assert time.monotonic() < deadline, (r.zrange("gw:reqs", 0, -1), r.keys("gw:req:*"))
        time.sleep(0.05)
    day = sum(int(r.get(k) or 0) for k in r.keys("gw:tpd:key:bench:*"))
    assert day == billed  # tickets taken, bound, expired: no token counted twice or lost


def test_a_key_with_small_limits_takes_no_ticket(
        ahead_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = ahead_spoke
    c = client(spoke, keys["conc4"])
    for _ in range(5):
        c.chat.completions.create(model="mock-model", messages=MSG, max_tokens=3)
    assert tickets(spoke, "taken") == 0 and tickets(spoke, "refused") == 0
