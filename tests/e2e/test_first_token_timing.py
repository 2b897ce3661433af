"""ttft_ms and tpot_ms through real Envoy, for each metering source: time to the first token.

The mock engine thinks `x-mock-ttft-ms` before its first token, then writes one token every
`1 / x-mock-tokens-per-s`. A Responses stream sends `response.created` and an Anthropic one
`message_start` at once, before any token: the Envoy source once took TTFT from that first
byte (3-4 ms for a 400 ms engine TTFT) and TPOT from there (~111 ms for 10 ms a token),
where ext_proc took the first content event (~404 and ~11 ms).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
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


# Each API's first event that carries a token (the ones before it are bookkeeping).
FIRST_TOKEN = {
    "chat": lambda d: bool(d.get("choices") and d["choices"][0].get("delta", {}).get("content")),
    "completions": lambda d: bool(d.get("choices") and d["choices"][0].get("text")),
    "responses": lambda d: d.get("type") == "response.output_text.delta",
    "messages": lambda d: d.get("type") == "content_block_delta",
}
EPS_MS = 5  # the sidecar's and the test's clocks: rounding, not load


@pytest.mark.parametrize("api", list(STREAMS))
def test_ttft_is_the_first_tokens_and_tpot_the_pace_after_it(
        spoke: Spoke, keys: dict[str, str], api: str) -> None:
    """The bounds are the engine's pace (below) and what the client saw (above): the
    gateway's start is after the client sent, and every token reaches it before the
    client. (Fixed bounds, 150 ms over the engine's TTFT and 2.5x its pace, were load's:
    in the parallel run a Check alone has taken over 500 ms.)"""
    path, body = STREAMS[api]
    headers = {"authorization": f"Bearer {keys['good']}", "x-mock-ttft-ms": str(TTFT_MS),
               "x-mock-tokens-per-s": str(TOKENS_PER_S)}
    url = f"http://127.0.0.1:{spoke.listen_port}{path}"
    first_token_ms = None
    t0 = time.monotonic()
    with httpx.stream("POST", url, headers=headers, timeout=30,
                      json={"model": "mock-model", "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if first_token_ms is None and line.startswith("data: {") \
                    and FIRST_TOKEN[api](orjson.loads(line[6:])):
                first_token_ms = (time.monotonic() - t0) * 1000
        last_byte_ms = (time.monotonic() - t0) * 1000
        rid = r.headers["x-request-id"]
    assert first_token_ms is not None
    [e] = read_events(spoke.kafka_bootstrap, {rid})
    assert (e["outcome"], e["usage"]["completion_tokens"]) == ("completed", str(TOKENS))
    ttft, tpot = float(e["timing"]["ttft_ms"]), float(e["timing"]["tpot_ms"])
    why = (spoke.metering, api, e["timing"], f"client: first token {first_token_ms:.1f} ms, "
           f"last byte {last_byte_ms:.1f} ms")
    # From the first token (the engine's think time), not the first byte (a few ms), and
    # no later than the client got it.
    assert TTFT_MS <= ttft <= first_token_ms + EPS_MS, why
    # The last token at the engine's pace after the first (9 gaps of 10 ms; the Envoy
    # source counts to the engine's last byte, the end marker a few µs after the last
    # token), no later than the client's last byte: a pace taken from the first byte
    # (~111 ms a token once) or before the first token would end long after it.
    last_token_ms = ttft + (TOKENS - 1) * tpot
    engine_last_ms = TTFT_MS + (TOKENS - 1) * 1000 / TOKENS_PER_S
    assert engine_last_ms - EPS_MS <= last_token_ms <= last_byte_ms + EPS_MS, why
