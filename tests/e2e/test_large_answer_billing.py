"""A whole (non-streamed) answer too large for json_to_metadata to buffer still bills its
completion: a client must not get tokens free by asking for an answer past Envoy's
buffer limit. Through the real Envoy, each metering source."""

from __future__ import annotations

import httpx
import orjson

from devspoke.stack import Spoke
from gateway.envoyconf.bootstrap import BUFFER_HEADROOM_BYTES
from testkit.spoke import read_events

N = 2_200_000  # "tok0 tok1 ...": ~8 bytes a token, ~19 MB: past ext_proc's 16 MiB too


def test_a_large_whole_answer_bills_its_completion(spoke: Spoke, keys: dict[str, str]) -> None:
    r = httpx.post(f"{spoke.base_url}/chat/completions",
                   json={"model": "mock-model", "max_tokens": N,
                         "messages": [{"role": "user", "content": "hi"}]},
                   headers={"authorization": f"Bearer {keys['bench']}",
                            "x-mock-tokens-per-s": "1000000000", "x-mock-ttft-ms": "0"},
                   timeout=120)
    assert r.status_code == 200, r.text[:200]
    assert len(r.content) > 8 * 1024 * 1024 + BUFFER_HEADROOM_BYTES
    assert orjson.loads(r.content)["usage"]["completion_tokens"] == N
    [event] = read_events(spoke.kafka_bootstrap, {r.headers["x-request-id"]})
    assert (event["outcome"], event["status_code"]) == ("completed", 200)
    assert int(event["usage"]["completion_tokens"]) >= N // 2, event
