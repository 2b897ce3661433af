"""DESIGN §4 on the Anthropic Messages API, through real Envoy, with the official anthropic
SDK as the client: each refusal is the SDK's own typed error, in Anthropic's shape. (The
rate-limit rows run against both APIs in test_answers.py.)"""

from __future__ import annotations

import anthropic
import httpx
import httpx2
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


def _engine_saw(spoke: Spoke) -> list[dict[str, str]]:
    return list(httpx.get(f"{spoke.engine_url}/mock/stats").json()["last_headers"])


def test_the_key_as_x_api_key_or_bearer(spoke: Spoke, keys: dict[str, str]) -> None:
    """Each header on its own, as the SDK sends it (anthropic 2.x sends `api_key=` as
    `Authorization: Bearer` too: `x-api-key` is sent by clients that set it themselves)."""
    sent: list[dict[str, str]] = []

    def record(request: httpx2.Request) -> None:
        sent.append({k: v for k, v in request.headers.items()
                     if k in ("authorization", "x-api-key")})

    hooks = {"http_client": httpx2.Client(event_hooks={"request": [record]})}
    assert _create(anthropic_client(spoke, keys["good"], **hooks)).usage.output_tokens == 3
    assert _create(anthropic_client(spoke, keys["good"], bearer=True, **hooks)
                   ).usage.output_tokens == 3
    assert sent == [{"x-api-key": keys["good"]}, {"authorization": f"Bearer {keys['good']}"}]


@pytest.mark.parametrize("winner", ["authorization", "x-api-key"])
def test_both_key_headers_disagreeing_the_bearer_decides(spoke: Spoke, keys: dict[str, str],
                                                          winner: str) -> None:
    """Both sent, with different keys: `Authorization: Bearer` decides, whatever x-api-key
    says (a malformed one too: no falling back), and the engine sees neither, so the key
    billed is the key judged."""
    good, other = keys["good"], "sk-gw-nobody-" + "A" * 43
    bearer, x_api_key = (good, other) if winner == "authorization" else (other, good)
    headers = {"authorization": f"Bearer {bearer}", "x-api-key": x_api_key,
               "anthropic-version": "2023-06-01"}
    r = httpx.post(f"{spoke.base_url}/messages", headers=headers,
                   json={"model": "mock-model", "max_tokens": 2, "messages": HELLO})
    if winner == "x-api-key":
        _shape(r, 401, "authentication_error")
        return
    assert r.status_code == 200, r.text
    [seen] = _engine_saw(spoke)
    assert "authorization" not in seen and "x-api-key" not in seen
    assert seen["x-gateway-key-id"] == "good"
    r = httpx.post(f"{spoke.base_url}/messages", json={"model": "mock-model", "max_tokens": 2},
                   headers={"authorization": "Basic Zm9vOmJhcg==", "x-api-key": good})
    _shape(r, 401, "authentication_error")


def test_anthropic_version_and_beta_reach_the_engine_untouched(spoke: Spoke,
                                                               keys: dict[str, str]) -> None:
    beta = "interleaved-thinking-2025-05-14,token-efficient-tools-2025-02-19"
    c = anthropic_client(spoke, keys["good"], default_headers={"anthropic-beta": beta})
    c.messages.create(model="mock-model", max_tokens=2, messages=HELLO,  # type: ignore[arg-type]
                      stream=True).close()
    _create(anthropic_client(spoke, keys["good"], bearer=True,
                             default_headers={"anthropic-version": "2023-06-01"}))
    first, second = _engine_saw(spoke)
    assert first["anthropic-version"] == c.default_headers["anthropic-version"]
    assert first["anthropic-beta"] == beta
    assert second["anthropic-version"] == "2023-06-01" and "anthropic-beta" not in second


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


def test_tool_definitions_count_in_the_reservation(spoke: Spoke, keys: dict[str, str]) -> None:
    """Tools are input tokens: 20 tool definitions (~2,000 tokens of JSON) with a 2-word
    message and max_tokens 10 can never pass a 1,234-token window, and the SDK is told so
    (x-should-retry: false) instead of being admitted on a 1-token prompt estimate."""
    tool = {"name": "get_weather", "description": "Get the weather in a location. " * 10,
            "input_schema": {"type": "object", "properties": {
                "location": {"type": "string", "description": "The city, e.g. Paris"}}}}
    c = anthropic_client(spoke, keys["tpm1234"])
    with pytest.raises(anthropic.RateLimitError) as exc:
        c.messages.create(model="mock-model", max_tokens=10, messages=HELLO,  # type: ignore
                          tools=[{**tool, "name": f"tool_{i}"} for i in range(20)])
    _shape(exc.value.response, 429, "rate_limit_error")
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert "can never pass" in exc.value.message


def test_the_sdk_reads_the_request_id_of_every_answer(spoke: Spoke,
                                                      keys: dict[str, str]) -> None:
    """Anthropic's answers carry `request-id`, which the SDK hands out as a denial's
    `request_id` and a message's `_request_id`: the gateway's is its x-request-id (the usage
    event's id), on its denials, its allowed answers and Envoy's own JSON replies."""
    with pytest.raises(anthropic.AuthenticationError) as auth:
        _create(anthropic_client(spoke, "sk-gw-nobody-" + "A" * 43))
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_client(spoke, keys["good"]).post(
            "/v1/messages", cast_to=httpx.Response, body={"model": "mock-model", "messages": []})
    for e in (auth.value, bad.value):
        assert e.request_id == e.response.headers["x-request-id"] == e.response.json()["request_id"]
    message = _create(anthropic_client(spoke, keys["good"], bearer=True))
    raw = anthropic_client(spoke, keys["good"]).messages.with_raw_response.create(
        model="mock-model", max_tokens=3, messages=HELLO, stream=True)  # type: ignore[arg-type]
    raw.parse().close()
    assert message._request_id and raw.request_id == raw.headers["x-request-id"]
    [seen_message, _] = _engine_saw(spoke)
    assert message._request_id == seen_message["x-gateway-request-id"]
    with pytest.raises(anthropic.ContentTooLargeError) as big:
        anthropic_client(spoke, keys["good"], timeout=60).messages.create(
            model="mock-model", max_tokens=1,
            messages=[{"role": "user", "content": "x" * (9 << 20)}])
    assert big.value.request_id == big.value.response.headers["x-request-id"]
