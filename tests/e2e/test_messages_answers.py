"""DESIGN §4 on the Anthropic Messages API, through real Envoy, with the official anthropic
SDK as the client: each refusal is the SDK's own typed error, in Anthropic's shape. (The
rate-limit rows run against both APIs in test_answers.py.)"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from devspoke.stack import Spoke
from testkit.spoke import anthropic_client, read_events

AUTHZ_ONLY = True  # the answers are the Check's: one metering source proves it

HELLO = [{"role": "user", "content": "hello there"}]


def _create(c: anthropic.Anthropic, model: str = "mock-model") -> anthropic.types.Message:
    return c.messages.create(model=model, max_tokens=3, messages=HELLO)  # type: ignore[arg-type]


def _shape(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert body["error"]["message"] and body["request_id"] == r.headers["x-request-id"]


def test_allowed_messages_carry_anthropics_rate_limit_headers(spoke: Spoke,
                                                              keys: dict[str, str]) -> None:
    raw = anthropic_client(spoke, keys["rps1"]).messages.with_raw_response.create(
        model="mock-model", max_tokens=3, messages=HELLO)  # type: ignore[arg-type]
    assert raw.parse().usage.output_tokens == 3
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert "x-ratelimit-limit-requests" not in raw.headers


def test_the_key_as_x_api_key_or_bearer(spoke: Spoke, keys: dict[str, str]) -> None:
    assert _create(anthropic_client(spoke, keys["good"])).usage.output_tokens == 3
    assert _create(anthropic_client(spoke, keys["good"], bearer=True)).usage.output_tokens == 3


@pytest.mark.parametrize("key", ["sk-gw-nobody-" + "A" * 43, "expired", "disabled"])
def test_401_is_an_authentication_error(spoke: Spoke, keys: dict[str, str], key: str) -> None:
    with pytest.raises(anthropic.AuthenticationError) as exc:
        _create(anthropic_client(spoke, keys.get(key, key)))
    _shape(exc.value.response, 401, "authentication_error")
    [event] = read_events(spoke.kafka_bootstrap, {exc.value.response.headers["x-request-id"]})
    assert event["outcome"] == "denied" and event["endpoint"] == "/v1/messages"


def test_401_without_any_key(spoke: Spoke) -> None:
    r = httpx.post(f"{spoke.base_url}/messages", json={"model": "mock-model"})
    _shape(r, 401, "authentication_error")


def test_403_is_a_permission_error(spoke: Spoke, keys: dict[str, str]) -> None:
    with pytest.raises(anthropic.PermissionDeniedError) as exc:
        _create(anthropic_client(spoke, keys["good"]), model="other-model")  # team: mock-*
    _shape(exc.value.response, 403, "permission_error")
    with pytest.raises(anthropic.PermissionDeniedError):
        _create(anthropic_client(spoke, keys["narrow"]), model="mock-other")  # the key narrows


def test_404_unknown_model_and_unknown_url_are_not_found_errors(spoke: Spoke,
                                                                 keys: dict[str, str]) -> None:
    with pytest.raises(anthropic.NotFoundError) as exc:
        _create(anthropic_client(spoke, keys["good"]), model="no-such-model")
    _shape(exc.value.response, 404, "not_found_error")
    r = httpx.post(f"{spoke.base_url}/messages/batches", headers={"x-api-key": keys["good"]},
                   json={"requests": []})
    _shape(r, 404, "not_found_error")  # not passed through: no side door


@pytest.mark.parametrize("body", [b"{not json", b'{"messages": []}',
                                  b'{"model": "mock-model", "messages": []}',  # no max_tokens
                                  b'{"model": "mock-model", "max_tokens": -1, "messages": []}'])
def test_400_is_an_invalid_request_error(spoke: Spoke, keys: dict[str, str],
                                         body: bytes) -> None:
    r = httpx.post(f"{spoke.base_url}/messages", content=body,
                   headers={"x-api-key": keys["good"], "content-type": "application/json"})
    _shape(r, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):  # the SDK agrees
        anthropic_client(spoke, keys["good"]).post(
            "/v1/messages", cast_to=httpx.Response, body={"model": "mock-model", "messages": []})
