"""A request whose Check nobody answered (the sidecar frozen: Envoy's ext_authz timeout
answers 503) still gets its one usage event, `denied` with that 503, from either metering
source. With the ext_proc source that bodiless 503 on the API's POST routes opens no
ext_proc stream, so Envoy's record (sent for it alone, beside the cut streams', and retried
until the thawed sidecar answers) is what the event is made from; before, it got none."""

from __future__ import annotations

from collections import Counter

import httpx

from devspoke.stack import Spoke
from testkit.spoke import read_events


def test_a_check_nobody_answered_gets_one_denied_event(
        spoke_keys: tuple[Spoke, dict[str, str]]) -> None:
    """Both metering sources (conftest.py's `spoke_keys`)."""
    spoke, keys = spoke_keys
    chat = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}
    ok = httpx.post(f"{spoke.base_url}/chat/completions", json=chat, timeout=10,
                    headers={"authorization": f"Bearer {keys['good']}"})
    assert ok.status_code == 200
    spoke["sidecar"].pause()
    try:
        refused = [httpx.post(f"{spoke.base_url}/chat/completions", json=chat, timeout=10,
                              headers={"authorization": f"Bearer {keys['good']}"})
                   for _ in range(3)]
        refused.append(httpx.post(f"{spoke.base_url}/messages", timeout=10,
                                  headers={"x-api-key": keys["good"]}, json=chat))
    finally:
        spoke["sidecar"].resume()
    assert [r.status_code for r in refused] == [503] * 4
    want = {r.headers["x-request-id"] for r in refused}
    assert len(want) == 4
    events = read_events(spoke.kafka_bootstrap, want | {ok.headers["x-request-id"]},
                         timeout=30)
    mine = [e for e in events if e["event_id"] in want]
    assert Counter(e["event_id"] for e in mine) == dict.fromkeys(want, 1), mine
    for e in mine:
        assert (e["outcome"], e["status_code"]) == ("denied", 503), e
        assert int(e["usage"]["total_tokens"]) == 0
    assert {e["endpoint"] for e in mine} == {"/v1/chat/completions", "/v1/messages"}
