"""Every row of DESIGN §4, through real Envoy, with the official openai SDK as the client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from gateway.dev.stack import Spoke
from testkit.spoke import chat, client, read_events

AUTHZ_ONLY = True  # the answers are the Check's: one metering source proves it


def test_allowed_request_carries_rate_headers(spoke: Spoke, keys: dict[str, str]) -> None:
    raw = client(spoke, keys["good"]).chat.completions.with_raw_response.create(
        model="mock-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert raw.status_code == 200
    assert raw.parse().usage.completion_tokens == 3
    tiers = client(spoke, keys["rps1"]).chat.completions.with_raw_response.create(
        model="mock-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert tiers.headers["x-ratelimit-limit-requests"] == "1"
    assert tiers.headers["x-ratelimit-remaining-requests"] == "0"


def test_401_without_any_key(spoke: Spoke) -> None:
    r = httpx.post(f"{spoke.base_url}/chat/completions", json={"model": "mock-model"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("key", ["sk-gw-nobody-" + "A" * 43, "expired", "disabled"])
def test_401_invalid_api_key(spoke: Spoke, keys: dict[str, str], key: str) -> None:
    secret = keys.get(key, key)
    with pytest.raises(openai.AuthenticationError) as exc:
        chat(client(spoke, secret))
    assert exc.value.status_code == 401
    assert exc.value.code == "invalid_api_key"
    # billing sees who was refused, when the key was known (expired, disabled, revoked)
    [event] = read_events(spoke.kafka_bootstrap, {exc.value.response.headers["x-request-id"]})
    assert event["outcome"] == "denied" and event["key_id"] == (key if key in keys else "")


def test_x_api_key_header_also_works(spoke: Spoke, keys: dict[str, str]) -> None:
    r = httpx.post(f"{spoke.base_url}/chat/completions", headers={"x-api-key": keys["good"]},
                   json={"model": "mock-model", "messages": [], "max_tokens": 1})
    assert r.status_code == 200


def test_404_model_not_found(spoke: Spoke, keys: dict[str, str]) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        chat(client(spoke, keys["good"]), model="no-such-model")
    assert exc.value.code == "model_not_found"


def test_403_model_not_allowed_for_team_or_key(spoke: Spoke, keys: dict[str, str]) -> None:
    with pytest.raises(openai.PermissionDeniedError) as exc:
        chat(client(spoke, keys["good"]), model="other-model")  # team t1 allows mock-* only
    assert exc.value.code == "model_not_allowed"
    chat(client(spoke, keys["good"]), model="mock-other")  # the team allows it ...
    with pytest.raises(openai.PermissionDeniedError):
        chat(client(spoke, keys["narrow"]), model="mock-other")  # ... the key narrows it


@pytest.mark.parametrize("body", [b"{not json", b"[1,2]", b'{"messages": []}', b'{"model": 7}'])
def test_400_invalid_request(spoke: Spoke, keys: dict[str, str], body: bytes) -> None:
    r = httpx.post(f"{spoke.base_url}/chat/completions", content=body,
                   headers={"authorization": f"Bearer {keys['good']}",
                            "content-type": "application/json"})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "invalid_request_error"


def test_429_rps_names_tier_and_carries_headers(spoke: Spoke, keys: dict[str, str]) -> None:
    c = client(spoke, keys["rps1"])
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(3):
            chat(c)
    e = exc.value
    assert e.code == "rate_limit_exceeded"
    assert "key tier" in e.message and "rps" in e.message
    h = e.response.headers
    assert int(h["retry-after"]) >= 1
    assert h["x-gateway-limit-tier"] == "key"
    for name in ("limit", "remaining", "reset"):
        assert f"x-ratelimit-{name}-requests" in h
    assert e.type == "requests"


def test_429_team_tier(spoke: Spoke, keys: dict[str, str]) -> None:
    c = client(spoke, keys["teamrps"])
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(3):
            chat(c)
    assert exc.value.response.headers["x-gateway-limit-tier"] == "team"


def test_429_tokens_per_minute_is_rate_limit(spoke: Spoke, keys: dict[str, str]) -> None:
    c = client(spoke, keys["tpm"])
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(5):
            chat(c, max_tokens=300)  # reserves ~300 + prompt of a 400-token minute
    assert exc.value.code == "rate_limit_exceeded" and exc.value.type == "tokens"
    assert "tokens_per_minute" in exc.value.message
    assert "x-ratelimit-limit-tokens" in exc.value.response.headers
    assert "x-ratelimit-limit-requests" not in exc.value.response.headers  # binding tier only


def test_429_tokens_per_day_is_insufficient_quota(spoke: Spoke, keys: dict[str, str]) -> None:
    c = client(spoke, keys["tpd"])
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(5):
            chat(c, max_tokens=300)
    assert exc.value.code == "insufficient_quota"
    assert exc.value.response.headers["x-gateway-limit-tier"] == "key"


def test_spoofed_context_headers_are_replaced(spoke: Spoke, keys: dict[str, str]) -> None:
    chat(client(spoke, keys["good"], default_headers={
        "x-gateway-team": "evil", "x-gateway-key-id": "admin", "x-gateway-extra": "1",
        "X-Gateway-Model": "gpt-free"}))
    seen = httpx.get(f"{spoke.engine_url}/mock/stats").json()["last_headers"][-1]
    assert seen["x-gateway-team"] == "t1"
    assert seen["x-gateway-key-id"] == "good"
    assert seen["x-gateway-model"] == "mock-model"
    assert "x-gateway-extra" not in seen


def test_api_key_never_reaches_the_engine(spoke: Spoke, keys: dict[str, str]) -> None:
    chat(client(spoke, keys["good"]))
    httpx.post(f"{spoke.base_url}/chat/completions", headers={"x-api-key": keys["good"]},
               json={"model": "mock-model", "messages": [], "max_tokens": 1})
    stats = httpx.get(f"{spoke.engine_url}/mock/stats").json()
    assert stats["requests"] == 2
    for headers in stats["last_headers"]:
        assert "authorization" not in headers and "x-api-key" not in headers
        assert keys["good"] not in str(headers)
    sidecar_log = spoke["sidecar"].log_path.read_text()
    assert keys["good"] not in sidecar_log


def test_a_denial_is_logged_with_its_request_and_key_ids(
        spoke: Spoke, keys: dict[str, str]) -> None:
    r = httpx.post(f"{spoke.base_url}/chat/completions",
                   headers={"authorization": f"Bearer {keys['narrow']}"},
                   json={"model": "mock-other", "messages": [], "max_tokens": 1})
    assert r.status_code == 403
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in spoke["sidecar"].log_path.read_text().splitlines()
                 if rid in line]
        if lines:
            break
        time.sleep(0.05)
    [line] = lines
    assert line["event"] == "denied" and line["key_id"] == "narrow"
    assert line["status"] == 403 and line["reason"] == "model_not_allowed"
    assert keys["narrow"] not in spoke["sidecar"].log_path.read_text()
