"""End cases of "one usage event per request" through real Envoy, both metering sources:
an engine that compresses its answers."""

from __future__ import annotations

import httpx
import pytest

from devspoke.stack import Spoke
from testkit.spoke import client, read_events

MSG = [{"role": "user", "content": "count these five words"}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_engine_that_compresses_is_metered_from_what_it_reported(
        spoke: Spoke, keys: dict[str, str], stream: bool) -> None:
    """The openai SDK asks for gzip (httpx's default Accept-Encoding); an engine behind a
    compressing proxy answers so. Neither Envoy's filters nor ext_proc can read compressed
    bytes: the request goes to the engine without Accept-Encoding, so its answer is plain."""
    c = client(spoke, keys["good"], default_headers={"x-mock-compress": "1"})
    raw = c.chat.completions.with_raw_response.create(
        model="mock-model", messages=MSG, max_tokens=5, stream=stream)
    if stream:
        assert len(list(raw.parse())) >= 5  # no usage chunk: the client did not ask for it
    else:
        assert raw.parse().usage.completion_tokens == 5
    [e] = read_events(spoke.kafka_bootstrap, {raw.headers["x-request-id"]})
    assert (e["outcome"], e["usage_source"]) == ("completed", "reported")
    engine = httpx.get(f"{spoke.engine_url}/mock/stats").json()["usage_reported"]
    assert int(e["usage"]["completion_tokens"]) == engine["completion_tokens"] == 5
