"""ttft_ms and tpot_ms through real Envoy, for each metering source: time to the first token.

The mock engine thinks `x-mock-ttft-ms` before its first token, then writes one token every
`1 / x-mock-tokens-per-s`. A Responses stream sends `response.created` and an Anthropic one
`message_start` at once, before any token: the Envoy source once took TTFT from that first
byte (3-4 ms for a 400 ms engine TTFT) and TPOT from there (~111 ms for 10 ms a token),
where ext_proc took the first content event (~404 and ~11 ms).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from devspoke.stack import Spoke
from testkit.spoke import read_events

TTFT_MS, TOKENS_PER_S, TOKENS = 400, 100, 10  # 10 ms a token
MSG = [{"role": "user", "content": "count these five words"}]
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": MSG, "max_tokens": TOKENS}),
    "completions": ("/v1/completions", {"prompt": "one two three", "max_tokens": TOKENS}),
    "responses": ("/v1/responses", {"input": "hi there", "max_output_tokens": TOKENS}),
    "messages": ("/v1/messages", {"messages": MSG, "max_tokens": TOKENS}),
}


@pytest.mark.parametrize("api", list(STREAMS))
def test_ttft_is_the_first_tokens_and_tpot_the_pace_after_it(
        spoke: Spoke, keys: dict[str, str], api: str) -> None:
    path, body = STREAMS[api]
    headers = {"authorization": f"Bearer {keys['good']}", "x-mock-ttft-ms": str(TTFT_MS),
               "x-mock-tokens-per-s": str(TOKENS_PER_S)}
    url = f"http://127.0.0.1:{spoke.listen_port}{path}"
    with httpx.stream("POST", url, headers=headers, timeout=10,
                      json={"model": "mock-model", "stream": True, **body}) as r:
        assert r.status_code == 200
        r.read()
        rid = r.headers["x-request-id"]
    [e] = read_events(spoke.kafka_bootstrap, {rid})
    assert (e["outcome"], e["usage"]["completion_tokens"]) == ("completed", str(TOKENS))
    ttft, tpot = float(e["timing"]["ttft_ms"]), float(e["timing"]["tpot_ms"])
    # the engine's think time, plus what Envoy and the sidecar add on a loaded machine
    assert TTFT_MS <= ttft < TTFT_MS + 150, (spoke.metering, api, e["timing"])
    # 9 gaps of 10 ms after the first token (the Envoy source counts to the engine's last
    # byte, the end marker a few µs after the last token)
    assert 1000 / TOKENS_PER_S * 0.8 <= tpot < 1000 / TOKENS_PER_S * 2.5, (
        spoke.metering, api, e["timing"])
