"""A whole (non-streamed) answer too large for json_to_metadata to buffer still bills its
completion: a client must not get tokens free by asking for an answer past Envoy's
buffer limit. Through the real Envoy, each metering source."""

from __future__ import annotations

import httpx
import orjson

from devspoke.stack import Spoke
from gateway.envoyconf.bootstrap import BUFFER_HEADROOM_BYTES
from gateway.metering.meter import MAX_JSON_BODY
from testkit.spoke import read_events

# "tok0 tok1 ...", ~10 bytes a token: each source's answer just past the size its reader
# gives up on (the Envoy source's 8 MiB buffer limit, ~9 MB; ext_proc's MAX_JSON_BODY,
# 16 MiB, ~17.5 MB). The mock engine generates some 400,000 tokens a second at best.
N = {"envoy": 900_000, "ext_proc": 1_700_000}
TOO_LARGE = {"envoy": 8 * 1024 * 1024 + BUFFER_HEADROOM_BYTES, "ext_proc": MAX_JSON_BODY}


def test_a_large_whole_answer_bills_its_completion(spoke: Spoke, keys: dict[str, str]) -> None:
    n = N[spoke.metering]
    r = httpx.post(f"{spoke.base_url}/chat/completions",
                   json={"model": "mock-model", "max_tokens": n,
                         "messages": [{"role": "user", "content": "hi"}]},
                   headers={"authorization": f"Bearer {keys['bench']}",
                            "x-mock-tokens-per-s": "0", "x-mock-ttft-ms": "0"},  # no delay
                   timeout=120)
    assert r.status_code == 200, r.text[:200]
    assert len(r.content) > 8 * 1024 * 1024 + BUFFER_HEADROOM_BYTES
    assert len(r.content) > TOO_LARGE[spoke.metering]
    assert orjson.loads(r.content)["usage"]["completion_tokens"] == n
    [event] = read_events(spoke.kafka_bootstrap, {r.headers["x-request-id"]})
    assert (event["outcome"], event["status_code"]) == ("completed", 200)
    assert int(event["usage"]["completion_tokens"]) >= n // 2, event
