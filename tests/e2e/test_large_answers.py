"""A whole JSON answer larger than Envoy's buffer limit, through real Envoy, for each
metering source: the client gets it whole and its request one event that bills it."""

from __future__ import annotations

import httpx
import orjson

from devspoke.stack import Spoke
from gateway.envoyconf.bootstrap import BUFFER_HEADROOM_BYTES
from testkit.spoke import read_events


def test_an_answer_past_envoys_buffer_limit_reaches_its_client(spoke: Spoke,
                                                               keys: dict[str, str]) -> None:
    """~12.5 MB of embeddings (the mock's 8-dimension vectors, ~140 bytes each), past the
    8 MiB + headroom Envoy buffers: json_to_metadata buffered it whole, and Envoy answered
    500 after the engine had done the work."""
    n = 90_000
    r = httpx.post(f"{spoke.base_url}/embeddings",
                   json={"model": "mock-model", "input": ["a"] * n},
                   headers={"authorization": f"Bearer {keys['good']}"}, timeout=60)
    assert r.status_code == 200, r.text[:200]
    assert len(r.content) > 8 * 1024 * 1024 + BUFFER_HEADROOM_BYTES
    assert len(orjson.loads(r.content)["data"]) == n
    [event] = read_events(spoke.kafka_bootstrap, {r.headers["x-request-id"]})
    assert (event["outcome"], event["status_code"]) == ("completed", 200)
    assert int(event["usage"]["prompt_tokens"]) >= n  # reported (n), or estimated
    assert event["usage"]["completion_tokens"] == "0"
