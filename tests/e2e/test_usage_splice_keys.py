"""A client cannot turn off the usage the gateway asks the engine for (and so be billed on an
estimate) by spelling `stream_options` so that the gateway's byte splice misses the member
the engine reads: an escaped key (`"stream_opt\\u0069ons"`), or the member twice (JSON
parsers keep the last). Through the real Envoy, both metering sources, both Check doors."""

from __future__ import annotations

import httpx
import pytest

from devspoke.stack import Spoke
from testkit.spoke import read_events

ALSO_GRPC_CHECK = True

MSG = '"messages":[{"role":"user","content":"count these five words"}]'
OFF = '{"include_usage":false}'
HEAD = '"model":"mock-model",' + MSG + ',"max_tokens":6,"stream":true'
BODIES = {
    "escaped key": "{" + HEAD + ',"stream_opt\\u0069ons":' + OFF + "}",
    "escaped key, null": "{" + HEAD + ',"stream_opt\\u0069ons":null}',
    "twice": '{"stream_options":' + OFF + "," + HEAD + ',"stream_options":' + OFF + "}",
    "twice, escaped last": '{"stream_options":' + OFF + "," + HEAD
                           + ',"stream_optio\\u006es":' + OFF + "}",
}


@pytest.mark.parametrize("name", list(BODIES))
def test_client_cannot_hide_stream_options_from_the_splice(spoke: Spoke, keys: dict[str, str],
                                                           name: str) -> None:
    r = httpx.post(f"{spoke.base_url}/chat/completions", content=BODIES[name].encode(),
                   headers={"authorization": f"Bearer {keys['good']}",
                            "content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert '"usage"' not in r.text  # the client asked for none, and sees none
    rid = r.headers["x-request-id"]
    (event,) = read_events(spoke.kafka_bootstrap, {rid})
    assert event["usage_source"] == "reported", event
    assert event["usage"]["completion_tokens"] == "6"
