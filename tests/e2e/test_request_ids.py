"""An Envoy that keeps the client's x-request-id (`gateway envoy-config --keep-request-ids`,
behind a trusted front proxy): one id, one admission. A client repeating one id on
concurrent requests must not share a slot (and so bypass the concurrency limit), nor have
the refused request's denial take the admitted one's event id."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devspoke.stack import Spoke
from gateway.settings import METERING_SOURCES
from testkit.spoke import read_events, start_spoke


@pytest.fixture(params=METERING_SOURCES)
def keeping_spoke(request: pytest.FixtureRequest,
                  tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = start_spoke(tmp_path / "spoke", metering=request.param, keep_request_ids=True)
    yield spoke, keys
    spoke.stop()


def test_one_repeated_id_cannot_bypass_the_concurrency_limit(
        keeping_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = keeping_spoke
    statuses: list[int] = []
    started = threading.Barrier(6)

    def stream() -> None:
        body = {"model": "mock-model", "max_tokens": 60, "stream": True,
                "messages": [{"role": "user", "content": "same id"}]}
        started.wait(10)
        with httpx.stream("POST", f"{spoke.base_url}/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {keys['conc4']}",
                                   "x-request-id": "client-chosen-1",
                                   "x-mock-tokens-per-s": "30"}) as r:
            statuses.append(r.status_code)
            body_text = r.read().decode()
            if r.status_code == 409:
                assert "already in flight" in body_text

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert sorted(statuses) == [200] + [409] * 5  # one admission for one id
    [event] = read_events(spoke.kafka_bootstrap, {"client-chosen-1"}, settle=1.5)
    assert event["outcome"] == "completed" and event["status_code"] == 200
    assert int(event["usage"]["completion_tokens"]) == 60  # the admitted one's, not a denial's
    # Once it ended, the id may be used again (a retry of the same request, say).
    r = httpx.post(f"{spoke.base_url}/chat/completions", timeout=30,
                   headers={"authorization": f"Bearer {keys['conc4']}",
                            "x-request-id": "client-chosen-1"},
                   json={"model": "mock-model", "max_tokens": 2, "messages": []})
    assert r.status_code == 200
