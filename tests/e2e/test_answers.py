"""Every row of DESIGN §4, through real Envoy, with the official openai SDK as the client."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime

import anthropic
import httpx
import openai
import pytest

from devspoke.stack import Spoke
from testkit.envoys import access_log_entry
from testkit.spoke import anthropic_client, chat, client, read_events

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


@pytest.mark.parametrize("model", ["modèle-ü", "模型", "a\r\nx-evil: 1", "m" * 5000])
def test_any_model_name_gets_its_404_and_its_event(spoke: Spoke, keys: dict[str, str],
                                                    model: str) -> None:
    """The client's model name travels back in the denial's metadata (a header of the HTTP
    door's answer): non-ASCII, a CR LF or 5,000 characters still give the 404, its body
    naming the model, and the denial's usage event."""
    r = httpx.post(f"{spoke.base_url}/chat/completions",
                   headers={"authorization": f"Bearer {keys['good']}"},
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found" and model in r.json()["error"]["message"]
    assert "x-evil" not in r.headers
    [event] = read_events(spoke.kafka_bootstrap, {r.headers["x-request-id"]})
    assert event["outcome"] == "denied" and event["status_code"] == 404


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


# The limit tests run against both API shapes: the tiers are the same, only the answer's
# shape differs (OpenAI's on chat completions, Anthropic's on the Messages API).
APIS = ["openai", "anthropic"]
HELLO = [{"role": "user", "content": "hello there"}]


def _ask(spoke: Spoke, key: str, api: str, max_tokens: int = 4) -> None:
    if api == "openai":
        chat(client(spoke, key), max_tokens=max_tokens)
    else:
        anthropic_client(spoke, key).messages.create(
            model="mock-model", max_tokens=max_tokens, messages=HELLO)  # type: ignore[arg-type]


def _limited(spoke: Spoke, key: str, api: str, tries: int = 3, max_tokens: int = 4
             ) -> openai.RateLimitError | anthropic.RateLimitError:
    """The SDK's own typed 429, raised within `tries` requests."""
    kind = openai.RateLimitError if api == "openai" else anthropic.RateLimitError
    with pytest.raises(kind) as exc:
        for _ in range(tries):
            _ask(spoke, key, api, max_tokens)
    return exc.value


def _error_type(e: openai.RateLimitError | anthropic.RateLimitError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    return str(body.get("error", {}).get("type") if "error" in body else body.get("type"))


def _rate_header(api: str, what: str, name: str) -> str:
    """x-ratelimit-limit-requests, or anthropic-ratelimit-requests-limit."""
    return f"x-ratelimit-{name}-{what}" if api == "openai" else \
        f"anthropic-ratelimit-{what}-{name}"


@pytest.mark.parametrize("api", APIS)
def test_429_rps_names_tier_and_carries_headers(spoke: Spoke, keys: dict[str, str],
                                                api: str) -> None:
    e = _limited(spoke, keys["rps1"], api)
    assert "key tier" in e.message and "rps" in e.message
    h = e.response.headers
    assert int(h["retry-after"]) >= 1
    assert h["x-gateway-limit-tier"] == "key"
    for name in ("limit", "remaining", "reset"):
        assert _rate_header(api, "requests", name) in h
    if api == "openai":
        assert isinstance(e, openai.RateLimitError)
        assert e.code == "rate_limit_exceeded" and e.type == "requests"
    else:
        assert _error_type(e) == "rate_limit_error"
        assert not any(k.startswith("x-ratelimit-") for k in h)  # one family of headers
        datetime.strptime(h["anthropic-ratelimit-requests-reset"], "%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("api", APIS)
def test_429_team_tier(spoke: Spoke, keys: dict[str, str], api: str) -> None:
    e = _limited(spoke, keys["teamrps"], api)
    assert e.response.headers["x-gateway-limit-tier"] == "team"


@pytest.mark.parametrize("api", APIS)
def test_429_tokens_per_minute_is_rate_limit(spoke: Spoke, keys: dict[str, str],
                                             api: str) -> None:
    e = _limited(spoke, keys["tpm"], api, tries=5, max_tokens=300)  # ~300 + prompt of 400/min
    assert "tokens_per_minute" in e.message
    assert _rate_header(api, "tokens", "limit") in e.response.headers
    # no tier of this key (nor its team t1, nor the model) has an rps: no requests family
    assert _rate_header(api, "requests", "limit") not in e.response.headers
    if api == "openai":
        assert isinstance(e, openai.RateLimitError)
        assert e.code == "rate_limit_exceeded" and e.type == "tokens"


@pytest.mark.parametrize("api", APIS)
def test_429_tokens_per_day_is_insufficient_quota(spoke: Spoke, keys: dict[str, str],
                                                  api: str) -> None:
    e = _limited(spoke, keys["tpd"], api, tries=5, max_tokens=300)
    assert e.response.headers["x-gateway-limit-tier"] == "key"
    assert "Quota exhausted" in e.message
    if api == "openai":
        assert isinstance(e, openai.RateLimitError) and e.code == "insufficient_quota"
    else:
        assert _error_type(e) == "rate_limit_error"


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
    deadline = time.monotonic() + 15  # a wait, not a bound: load is no failure
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


def test_access_log_says_how_long_the_gateway_held_a_request(
        spoke: Spoke, keys: dict[str, str]) -> None:
    """`to_engine_us`: the request's first byte to its first byte sent to the engine (the
    Check and the splice): an operator's measure of the latency the gateway adds. A request
    the engine never saw has none."""
    allowed = httpx.post(f"{spoke.base_url}/chat/completions",
                         headers={"authorization": f"Bearer {keys['good']}"},
                         json={"model": "mock-model", "messages": [], "max_tokens": 1})
    assert allowed.status_code == 200
    entry = access_log_entry(spoke["envoy"].log_path, "request_id",
                             allowed.headers["x-request-id"])
    held = entry["to_engine_us"]
    assert isinstance(held, int) and isinstance(entry["duration_ms"], int)
    assert 0 < held <= (entry["duration_ms"] + 1) * 1000
    denied = httpx.post(f"{spoke.base_url}/chat/completions", json={"model": "mock-model"})
    assert denied.status_code == 401
    assert access_log_entry(spoke["envoy"].log_path, "request_id",
                            denied.headers["x-request-id"]).get("to_engine_us") is None


def test_the_access_log_never_holds_a_query_string(spoke: Spoke) -> None:
    """A client that puts its key in the URL (`?api_key=`, as some SDKs allow) is refused,
    and Envoy's access log names the path without the query: no secret in the logs."""
    secret = "sk-gw-querykey-" + "q" * 43
    r = httpx.post(f"{spoke.base_url}/chat/completions?api_key={secret}",
                   json={"model": "mock-model", "messages": []})
    assert r.status_code == 401
    entry = access_log_entry(spoke["envoy"].log_path, "request_id", r.headers["x-request-id"])
    assert entry["path"] == "/v1/chat/completions"
    assert secret not in spoke["envoy"].log_path.read_text()


# --- issue 21: every answer in the API's shape; headers that are true ---------------------------


def test_a_body_over_the_limit_is_a_json_413_in_the_routes_shape(spoke: Spoke,
                                                                keys: dict[str, str]) -> None:
    """Envoy's own 413 (the body outgrew ext_authz's 8 MiB buffer) is JSON, as every other
    answer: OpenAI's on chat completions, Anthropic's on the Messages API (whose SDK raises
    its typed error)."""
    big = "x" * (9 << 20)
    with pytest.raises(openai.APIStatusError) as exc:
        client(spoke, keys["good"], timeout=60).chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": big}], max_tokens=1)
    r = exc.value.response
    assert r.status_code == 413 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["error"]["code"] == "request_too_large" and "8388608" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] is None
    assert body["request_id"] == r.headers["x-request-id"]
    with pytest.raises(anthropic.RequestTooLargeError) as aexc:
        anthropic_client(spoke, keys["good"], timeout=60).messages.create(
            model="mock-model", max_tokens=1, messages=[{"role": "user", "content": big}])
    r = aexc.value.response
    assert r.headers["content-type"] == "application/json"
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    assert r.json()["request_id"] == r.headers["x-request-id"]


@pytest.mark.parametrize("api", APIS)
def test_an_rps_429_from_a_tier_with_a_token_limit_says_its_tokens(
        spoke: Spoke, keys: dict[str, str], api: str) -> None:
    """Key, team and model tier: the denial carries the binding tier's token numbers too."""
    e = _limited(spoke, keys["rps1tpm"], api)
    h = e.response.headers
    assert "rps" in e.message and h["x-gateway-limit-tier"] == "key"
    assert h[_rate_header(api, "tokens", "limit")] == "100000"
    assert int(h[_rate_header(api, "tokens", "remaining")]) < 100000  # the first one's share
    if api == "anthropic":
        for kind in ("input-tokens", "output-tokens"):
            assert h[f"anthropic-ratelimit-{kind}-limit"] == "100000"
    h = _limited(spoke, keys["teamtpm"], api).response.headers
    assert h["x-gateway-limit-tier"] == "team"
    assert h[_rate_header(api, "requests", "limit")] == "1"
    assert h[_rate_header(api, "tokens", "limit")] == "200000"
    c = client(spoke, keys["wide"])
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(3):
            chat(c, model="tight-model")
    h = exc.value.response.headers
    assert h["x-gateway-limit-tier"] == "model"
    assert h["x-ratelimit-limit-requests"] == "1" and h["x-ratelimit-limit-tokens"] == "1000000"


@pytest.mark.parametrize("api", APIS)
def test_a_token_429_says_its_tiers_requests(spoke: Spoke, keys: dict[str, str],
                                             api: str) -> None:
    """The issue's Anthropic row: a 429 on a token limit has the requests family in full."""
    e = _limited(spoke, keys["rpstpm"], api, tries=5, max_tokens=300)
    h = e.response.headers
    assert "tokens_per_minute" in e.message
    assert h[_rate_header(api, "requests", "limit")] == "50"
    assert h[_rate_header(api, "tokens", "limit")] == "400"
    for name in ("remaining", "reset"):
        assert _rate_header(api, "requests", name) in h
        assert _rate_header(api, "tokens", name) in h


@pytest.mark.parametrize("api", APIS)
def test_a_quota_429_of_a_key_without_rps_says_its_teams_requests(
        spoke: Spoke, keys: dict[str, str], api: str) -> None:
    """A key whose only limit is tokens_per_day, in a team with an rps: its quota 429 has
    both families, the key's tokens and the team's requests, as they stand."""
    e = _limited(spoke, keys["tpdteamrps"], api, tries=5, max_tokens=300)
    h = e.response.headers
    assert "Quota exhausted" in e.message and "tokens_per_day=400" in e.message
    assert h["x-gateway-limit-tier"] == "key"
    assert h[_rate_header(api, "tokens", "limit")] == "400"
    assert int(h[_rate_header(api, "tokens", "remaining")]) < 400
    assert h[_rate_header(api, "requests", "limit")] == "2"  # the team's rps
    assert int(h[_rate_header(api, "requests", "remaining")]) <= 2
    for what in ("requests", "tokens"):
        assert _rate_header(api, what, "reset") in h
    if api == "anthropic":
        assert not any(k.startswith("x-ratelimit-") for k in h)  # one family of headers
        for kind in ("input-tokens", "output-tokens"):
            assert h[f"anthropic-ratelimit-{kind}-limit"] == "400"
        datetime.strptime(h["anthropic-ratelimit-requests-reset"], "%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("api", APIS)
def test_max_tokens_beyond_the_whole_limit_is_refused_as_impossible(
        spoke: Spoke, keys: dict[str, str], api: str) -> None:
    """max_tokens 4321 against a whole tokens_per_minute of 1234: refused with both numbers,
    no retry-after, and nothing consumed (a request that fits still passes)."""
    e = _limited(spoke, keys["tpm1234"], api, tries=1, max_tokens=4321)
    h = e.response.headers
    assert "never pass" in e.message and "tokens_per_minute=1234" in e.message
    assert "completion 4321" in e.message
    assert "retry-after" not in h and h["x-should-retry"] == "false"
    assert h[_rate_header(api, "tokens", "limit")] == "1234"
    again = _limited(spoke, keys["tpm1234"], api, tries=1, max_tokens=4321).response.headers
    remaining = _rate_header(api, "tokens", "remaining")
    # The first refusal consumed nothing: what remains did not shrink (it may grow meanwhile,
    # as the previous minute's use, the other API's run with this key, slides out).
    assert int(again[remaining]) >= int(h[remaining])
    _ask(spoke, keys["tpm1234"], api, max_tokens=100)


def test_a_huge_prompt_is_refused_as_impossible_at_the_model_tier(
        spoke: Spoke, keys: dict[str, str]) -> None:
    """A 5 MiB prompt (estimate ~1.3 M tokens; the issue's was 7 MiB) against a model tier of
    1 M tokens a minute: the reservation cap bounds max_tokens only, so it is refused, not
    admitted to eat the model's minute for everyone."""
    c = client(spoke, keys["wide"], timeout=60)
    with pytest.raises(openai.RateLimitError) as exc:
        chat(c, model="tight-model", max_tokens=10,
             messages=[{"role": "user", "content": "x" * (5 << 20)}])
    e = exc.value
    assert e.response.headers["x-gateway-limit-tier"] == "model"
    assert "never pass" in e.message and "tokens_per_minute=1000000" in e.message
    assert "prompt estimate 1310725 + completion 10" in e.message
    assert "retry-after" not in e.response.headers
    time.sleep(1)  # the model tier's rps (1/s), not its tokens, is all the next one waits for
    assert chat(c, model="tight-model").usage.completion_tokens == 4


def _to_midnight() -> float:
    return 86400 - time.time() % 86400


def _duration_s(text: str) -> float:
    """'3h2m1s', '59m48s', '48s' (answers.duration) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts is not None and text, text
    h, m, sec = (int(x or 0) for x in parts.groups())
    return h * 3600 + m * 60 + sec


def test_the_429_names_the_limit_that_binds_the_wait(spoke: Spoke, keys: dict[str, str]) -> None:
    """The key's rps (one request in 20 s) and its day quota (until midnight UTC) both
    refuse: both SDKs are told the quota, its numbers and its wait, not the rps checked
    first and a retry in seconds."""
    key = keys["slowtpd"]
    chat(client(spoke, key), max_tokens=300)  # ~300 of the day's 400, and the rps's cell
    with pytest.raises(openai.RateLimitError) as oa:
        chat(client(spoke, key), max_tokens=300)
    with pytest.raises(anthropic.RateLimitError) as an:
        _ask(spoke, key, "anthropic", max_tokens=300)
    with pytest.raises(openai.RateLimitError) as rps:  # the rps was refusing all along
        chat(client(spoke, key), max_tokens=1)
    assert rps.value.code == "rate_limit_exceeded" and "rps=0.05" in rps.value.message
    assert 1 <= int(rps.value.response.headers["retry-after"]) <= 20
    # Each SDK's own retry decision: the rps 429 is retried after its seconds; the quota's
    # is not (the Anthropic SDK would sleep its retry-after, hours, before retrying)
    sdks = (openai.OpenAI(api_key="x"), anthropic.Anthropic(api_key="x"))
    assert all(sdk._should_retry(rps.value.response) for sdk in sdks)
    assert not any(sdk._should_retry(e.value.response) for sdk in sdks for e in (oa, an))
    for e in (oa.value, an.value):
        h = e.response.headers
        assert "key tier limit tokens_per_day=400" in e.message, e.message
        assert "Quota exhausted" in e.message and h["x-gateway-limit-tier"] == "key"
        assert abs(int(h["retry-after"]) - _to_midnight()) < 5, h["retry-after"]
    assert oa.value.code == "insufficient_quota" and oa.value.type == "insufficient_quota"
    h = oa.value.response.headers
    assert h["x-ratelimit-limit-tokens"] == "400"
    assert int(h["x-ratelimit-remaining-tokens"]) < 100
    # OpenAI's reset format ('3h2m1s'; '59m48s' in the last hour before midnight, UTC)
    assert abs(_duration_s(h["x-ratelimit-reset-tokens"]) - _to_midnight()) < 5, h
    assert _error_type(an.value) == "rate_limit_error"
    h = an.value.response.headers
    assert h["anthropic-ratelimit-tokens-limit"] == "400"
    reset = datetime.fromisoformat(h["anthropic-ratelimit-tokens-reset"].replace("Z", "+00:00"))
    assert abs(reset.timestamp() - (time.time() + _to_midnight())) < 5


def test_count_tokens_passes_a_spent_token_window(spoke: Spoke, keys: dict[str, str]) -> None:
    """The day's 400 tokens overspent (a prompt of 500 words the estimate puts at ~250):
    count_tokens, free at Anthropic, is still answered; a completion of 0 tokens, on either
    API, still has a prompt to bill and is refused."""
    key = keys["counttpd"]
    words = [{"role": "user", "content": "a " * 500}]
    chat(client(spoke, key), messages=words, max_tokens=1)
    deadline = time.monotonic() + 10
    while True:  # until its settlement (501 tokens) reached the day's counter
        try:
            chat(client(spoke, key), messages=HELLO, max_tokens=0)
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota" and "tokens_per_day" in exc.message
            break
        assert time.monotonic() < deadline, "the first request never settled"
        time.sleep(0.2)
    with pytest.raises(anthropic.RateLimitError) as an:
        anthropic_client(spoke, key).messages.create(
            model="mock-model", max_tokens=0, messages=HELLO)  # type: ignore[arg-type]
    assert "tokens_per_day" in an.value.message
    raw = anthropic_client(spoke, key).messages.with_raw_response.count_tokens(
        model="mock-model", messages=HELLO)  # type: ignore[arg-type]
    assert raw.status_code == 200 and raw.parse().input_tokens == 2
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "20"
    assert "anthropic-ratelimit-tokens-limit" not in raw.headers  # no token window looked at
    with pytest.raises(openai.RateLimitError):  # and nothing was counted in one
        chat(client(spoke, key), messages=HELLO, max_tokens=0)


def test_an_image_is_reserved_as_an_image_not_as_its_base64(spoke: Spoke,
                                                            keys: dict[str, str]) -> None:
    """A 200 KB JPEG, base64, counted as text was ~67,000 tokens: refused as "can never
    pass" by a 50,000-token minute, through both SDKs. It now counts as one image."""
    data = "/9j/" + "A" * 270_000
    key = keys["vision"]
    r = client(spoke, key).chat.completions.create(
        model="mock-model", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}]}])
    assert r.choices[0].message.content is not None
    m = anthropic_client(spoke, key).messages.create(
        model="mock-model", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": data}},
            {"type": "text", "text": "What is in this picture?"}]}])
    assert m.content
