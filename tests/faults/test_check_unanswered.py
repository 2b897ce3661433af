"""A Check nobody answers fails closed through either of Envoy's ext_authz doors: a frozen
sidecar (SIGSTOP: the connection is open, nothing replies) gets each request a 503 at
Envoy's ext_authz timeout, and none reaches the engine. Peers: envoy #32476 (fail-closed
not applied to gRPC ext_authz on a timeout), envoyproxy/ratelimit #462 (fail-open with
stalls), wasm-shim #372 (the connection dropped instead of an answer). The 503 is in the
API's JSON shape, as the sidecar's own: Envoy alone answers it with no body. The Envoy
metering source (the default) only: the ext_proc source keeps Envoy's bare 503
(gateway/envoyconf/filters.py `local_replies`); its timeout is test_sidecar_faults.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devspoke.stack import Spoke
from gateway.settings import DEFAULT_METERING
from testkit.spoke import start_spoke


@pytest.fixture(params=[True, False], ids=["http-door", "grpc-check"])
def door_spoke(request: pytest.FixtureRequest,
               tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = start_spoke(tmp_path / "spoke", metering=DEFAULT_METERING,
                              authz_http=request.param)
    yield spoke, keys
    spoke.stop()


def _post(spoke: Spoke, key: str) -> tuple[int, float, httpx.Response]:
    t0 = time.monotonic()
    r = httpx.post(f"{spoke.base_url}/chat/completions", timeout=10,
                   headers={"authorization": f"Bearer {key}"},
                   json={"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 1})
    return r.status_code, time.monotonic() - t0, r


def _engine_requests(spoke: Spoke) -> int:
    return int(httpx.get(f"{spoke.engine_url}/mock/stats", timeout=5).json()["requests"])


def test_a_frozen_sidecar_is_a_503_at_the_timeout_and_nothing_reaches_the_engine(
        door_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = door_spoke
    assert _post(spoke, keys["fault"])[0] == 200
    before = _engine_requests(spoke)
    spoke["sidecar"].pause()
    try:
        answers = [_post(spoke, keys["fault"]) for _ in range(3)]
        messages = httpx.post(f"{spoke.base_url}/messages", timeout=10,
                              headers={"x-api-key": keys["fault"]},
                              json={"model": "mock-model", "max_tokens": 1,
                                    "messages": [{"role": "user", "content": "hi"}]})
    finally:
        spoke["sidecar"].resume()
    assert [code for code, _, _ in answers] == [503] * 3  # an answer, never an allow
    assert max(took for _, took, _ in answers) < 5  # at the timeout, not the thaw
    assert _engine_requests(spoke) == before
    for _, _, r in answers:  # in the API's shape (Envoy alone sends no body), retry-after 1
        assert r.json()["error"]["code"] == "service_unavailable", r.text
        assert r.json()["request_id"] == r.headers["x-request-id"]
        assert r.headers["retry-after"] == "1"
    assert (messages.status_code, messages.json()["error"]["type"]) == (503, "api_error")
    assert messages.headers["request-id"] == messages.headers["x-request-id"]  # the SDK's id
    deadline = time.monotonic() + 10
    while _post(spoke, keys["fault"])[0] != 200:  # and it serves again once thawed
        assert time.monotonic() < deadline, "not serving after the sidecar resumed"
        time.sleep(0.1)
    # The sidecar's own 503 (its Redis hung past the deadline) keeps the sidecar's words.
    spoke["redis"].pause()
    try:
        code, _, own = _post(spoke, keys["fault"])
    finally:
        spoke["redis"].resume()
    assert code == 503 and "Rate limiter unavailable" in own.json()["error"]["message"]
