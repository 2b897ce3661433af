"""Authorizer: every row of DESIGN §4, with a compiled policy, MemoryLimiter and FakeClock."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest

from gateway.authz import answers
from gateway.authz.decision import Allow, Decision, Deny, Reply
from gateway.authz.engine import AdmissionSettings, Authorizer
from gateway.authz.request import AuthzRequest
from gateway.clock import FakeClock
from gateway.errors import StoreInDoubt, StoreUnavailable
from gateway.limits.ledger import Ledger, Stage
from gateway.limits.memory import MemoryLimiter
from gateway.limits.types import AdmitRequest, DuplicateId, RateInfo, Refused, Verdict, Voided
from gateway.policy import secrets
from gateway.policy.loader import load
from gateway.policy.model import Policy

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
SECRETS = {name: f"sk-gw-{name}-{name * 8}" for name in ("alice", "bob", "old", "gone", "soon")}


def sha(name: str) -> str:
    return secrets.digest(SECRETS[name]).hex()


def policy(team_limits: str = "{}", key_limits: str = "{}", model_limits: str = "{}",
           team_global: str = "{}") -> Policy:
    return load(f"""
models:
  qwen3-coder: {{limits: {model_limits}}}
  llama-3: {{}}
  mistral: {{}}
teams:
  team-a:
    models: ["qwen3-coder", "llama-*"]
    limits: {team_limits}
    global_limits: {team_global}
keys:
  alice: {{team: team-a, sha256: "{sha("alice")}", limits: {key_limits}}}
  bob: {{team: team-a, sha256: "{sha("bob")}", models: ["llama-*"]}}
  old: {{team: team-a, sha256: "{sha("old")}", expires_at: "2027-01-15T07:59:59Z"}}
  soon: {{team: team-a, sha256: "{sha("soon")}", expires_at: "2027-01-15T08:00:01Z"}}
  gone: {{team: team-a, sha256: "{sha("gone")}", disabled: true}}
""", revision=1)


class CountingLimiter(MemoryLimiter):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def admit(self, req: AdmitRequest) -> Verdict:
        self.calls += 1
        return await super().admit(req)


class BrokenLimiter(CountingLimiter):
    async def admit(self, req: AdmitRequest) -> Verdict:
        self.calls += 1
        raise StoreUnavailable("redis: ConnectionError: connection refused")


class LateLimiter(CountingLimiter):
    """A store past its deadline: the admission may still commit after the caller left."""

    async def admit(self, req: AdmitRequest) -> Verdict:
        self.calls += 1
        raise StoreInDoubt("redis: no answer within 250 ms (timed out)")


class Gate:
    def __init__(self, pol: Policy | None, limiter: Any = None) -> None:
        self.clock = FakeClock(NOW)
        self.limiter = limiter if limiter is not None else CountingLimiter()
        self.ledger = Ledger(self.limiter, self.clock, lease_ttl=30)
        self.authz = Authorizer(lambda: pol, self.limiter, self.clock, AdmissionSettings(),
                                ledger=self.ledger)
        self.n = 0

    async def check(
        self,
        body: Any = None,
        *,
        who: str | None = "alice",
        headers: dict[str, str] | None = None,
        path: str = "/v1/chat/completions",
        method: str = "POST",
    ) -> Decision:
        self.n += 1
        h = dict(headers or {})
        if who is not None and headers is None:
            h["authorization"] = f"Bearer {SECRETS.get(who, who)}"
        if body is None:
            raw = b""
        elif isinstance(body, bytes):
            raw = body
        else:
            raw = json.dumps(body).encode()
        return await self.authz.check(AuthzRequest(f"req-{self.n}", method, path, h, raw))


def chat(model: str = "qwen3-coder", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def denied(d: Decision, status: int, code: str) -> Deny:
    assert isinstance(d, Deny), d
    assert (d.status, d.code) == (status, code), d
    return d


# --- allowed ------------------------------------------------------------------------------------


async def test_allowed_request_carries_verified_context() -> None:
    gate = Gate(policy(key_limits="{rps: 5}"))
    d = await gate.check(chat(stream=True, max_tokens=100))
    assert isinstance(d, Allow), d
    c = d.context
    assert (c.request_id, c.caller.key_id, c.caller.team, c.caller.model, c.stream) == (
        "req-1", "alice", "team-a", "qwen3-coder", True)
    assert d.rate.req_limit == 5 and d.rate.req_remaining == 4


async def test_allowed_with_x_api_key_header() -> None:
    gate = Gate(policy())
    d = await gate.check(chat("llama-3"), headers={"x-api-key": SECRETS["bob"]})
    assert isinstance(d, Allow) and d.context.caller.key_id == "bob"


async def test_allowed_without_limits_never_calls_the_limiter() -> None:
    gate = Gate(policy(), BrokenLimiter())
    d = await gate.check(chat())
    assert isinstance(d, Allow)
    assert not d.context.leased and d.context.reserved == 0
    assert gate.limiter.calls == 0


async def test_reservation_is_recorded_in_context() -> None:
    gate = Gate(policy(team_limits="{tokens_per_day: 100000}"))
    d = await gate.check(chat(max_tokens=500))
    assert isinstance(d, Allow) and d.context.leased
    assert 500 < d.context.reserved < 600  # max_tokens + a small prompt estimate


async def test_a_max_tokens_of_zero_reserves_no_completion() -> None:
    """0 is the body's cap like any other (parse_body reads it so): the reservation is the
    prompt alone, not the default completion, so a small token limit admits it."""
    gate = Gate(policy(key_limits="{tokens_per_minute: 100}"))
    one = await gate.check(chat(max_tokens=1))
    assert isinstance(one, Allow)
    prompt = one.context.reserved - 1
    for body in (chat(max_tokens=0), chat(max_completion_tokens=0, max_tokens=9)):
        d = await gate.check(body)
        assert isinstance(d, Allow), d
        assert d.context.reserved == prompt


async def test_key_expiring_later_is_valid() -> None:
    gate = Gate(policy())
    assert isinstance(await gate.check(chat(), who="soon"), Allow)
    gate.clock.advance(1)  # now == expires_at: expired
    denied(await gate.check(chat(), who="soon"), 401, "invalid_api_key")


async def test_models_listing_is_answered_for_the_keys_own_models() -> None:
    gate = Gate(policy(team_limits="{rps: 10, tokens_per_day: 2000}"))
    d = await gate.check(path="/v1/models", method="GET")
    assert isinstance(d, Reply) and d.status == 200, d
    assert [m["id"] for m in json.loads(d.body)["data"]] == ["llama-3", "qwen3-coder"]
    d = await gate.check(path="/v1/models", method="GET", who="bob")  # narrowed by the key
    assert isinstance(d, Reply)
    assert [m["id"] for m in json.loads(d.body)["data"]] == ["llama-3"]
    assert gate.limiter.calls == 0  # answered from the policy: no admission, no tokens
    denied(await gate.check(path="/v1/models", method="GET", who="nobody"),
           401, "invalid_api_key")


async def test_one_model_is_answered_only_if_the_key_may_use_it() -> None:
    gate = Gate(policy())
    d = await gate.check(path="/v1/models/llama-3", method="GET")
    assert isinstance(d, Reply) and json.loads(d.body)["id"] == "llama-3"
    denied(await gate.check(path="/v1/models/mistral", method="GET"), 403, "model_not_allowed")
    denied(await gate.check(path="/v1/models/nope", method="GET"), 404, "model_not_found")


# --- 401 / 404 / 403 / 400 ---------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "who"), [
    ({}, None),  # no key
    ({"authorization": "Bearer sk-gw-nobody-xxxxxxxx"}, None),  # unknown
    ({"authorization": "Basic YWxpY2U6cHc="}, None),  # wrong scheme
    (None, "old"),  # expired
    (None, "gone"),  # disabled
])
async def test_invalid_api_key(headers: dict[str, str] | None, who: str | None) -> None:
    gate = Gate(policy(key_limits="{rps: 1}"))
    d = denied(await gate.check(chat(), who=who, headers=headers), 401, "invalid_api_key")
    assert d.reason == "invalid_api_key"
    assert gate.limiter.calls == 0


async def test_unknown_key_is_rejected_before_the_body_is_read() -> None:
    gate = Gate(policy(), BrokenLimiter())
    denied(await gate.check(b"{not json", who="nobody"), 401, "invalid_api_key")


async def test_model_not_in_policy() -> None:
    gate = Gate(policy(team_limits="{rps: 1}"))
    d = denied(await gate.check(chat("gpt-4o")), 404, "model_not_found")
    assert "gpt-4o" in d.message
    assert gate.limiter.calls == 0


@pytest.mark.parametrize(("who", "model"), [
    ("alice", "mistral"),  # in the policy, not in the team's ACL
    ("bob", "qwen3-coder"),  # team allows it, the key narrows to llama-*
])
async def test_model_not_allowed(who: str, model: str) -> None:
    gate = Gate(policy(team_limits="{rps: 1}"))
    d = denied(await gate.check(chat(model), who=who), 403, "model_not_allowed")
    assert model in d.message
    assert gate.limiter.calls == 0
    # the denied request consumed nothing: the team's single rps cell is still free
    assert isinstance(await gate.check(chat("llama-3"), who=who), Allow)


@pytest.mark.parametrize("body", [
    b"",
    b"{not json",
    b"\xff\xfe",
    b'{"messages": []}',  # no model
    b'{"model": null}',
    b'{"model": ""}',
    b'{"model": 42}',  # model not a string
    b'{"model": ["qwen3-coder"]}',
    b'[{"model": "qwen3-coder"}]',  # a JSON array, not an object
    b'"qwen3-coder"',
])
async def test_bad_body(body: bytes) -> None:
    gate = Gate(policy(team_limits="{rps: 1}"))
    d = denied(await gate.check(body), 400, "invalid_request_error")
    assert d.message
    assert gate.limiter.calls == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/responses"])
async def test_every_inference_endpoint_needs_a_model(path: str) -> None:
    gate = Gate(policy())
    denied(await gate.check({"input": "x"}, path=path), 400, "invalid_request_error")
    assert isinstance(await gate.check({"model": "llama-3", "input": "x"}, path=path), Allow)


# --- 429 ---------------------------------------------------------------------------------------


def assert_429_headers(d: Deny, tier: str, *, requests: bool, tokens: bool) -> None:
    h = d.headers
    assert int(h["retry-after"]) >= 1
    assert h["retry-after"] == str(d.retry_after)
    assert h["x-gateway-limit-tier"] == tier == d.tier
    req = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
           "x-ratelimit-reset-requests")
    tok = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
           "x-ratelimit-reset-tokens")
    if requests:
        assert all(name in h for name in req), h
        assert h["x-ratelimit-remaining-requests"] == "0"
    if tokens:
        assert all(name in h for name in tok), h


async def test_rps_exceeded() -> None:
    gate = Gate(policy(key_limits="{rps: 2}"))
    assert isinstance(await gate.check(chat()), Allow)
    assert isinstance(await gate.check(chat()), Allow)
    d = denied(await gate.check(chat()), 429, "rate_limit_exceeded")
    assert d.reason == "rps"
    assert "key tier" in d.message and "rps=2" in d.message
    assert_429_headers(d, "key", requests=True, tokens=False)
    assert d.headers["x-ratelimit-limit-requests"] == "2"
    assert d.headers["retry-after"] == "1"  # 0.5 s, rounded up to whole seconds
    gate.clock.advance(0.5)
    assert isinstance(await gate.check(chat()), Allow)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_denial_says_whether_the_request_asked_for_a_stream(stream: bool) -> None:
    gate = Gate(policy(key_limits="{rps: 1}"))
    assert isinstance(await gate.check(chat()), Allow)
    assert denied(await gate.check(chat(stream=stream)), 429, "rate_limit_exceeded").stream \
        is stream
    assert denied(await gate.check(chat("mistral", stream=stream)), 403,
                  "model_not_allowed").stream is stream


async def test_concurrency_exceeded_at_model_tier() -> None:
    gate = Gate(policy(model_limits="{concurrency: 1}"))
    assert isinstance(await gate.check(chat()), Allow)
    d = denied(await gate.check(chat()), 429, "rate_limit_exceeded")
    assert d.reason == "concurrency"
    assert "model tier" in d.message and "concurrency=1" in d.message
    assert_429_headers(d, "model", requests=True, tokens=False)
    assert d.headers["x-ratelimit-limit-requests"] == "1"
    # another model does not share the qwen3-coder slot
    assert isinstance(await gate.check(chat("llama-3")), Allow)


async def test_tokens_per_minute_exceeded() -> None:
    gate = Gate(policy(team_limits="{tokens_per_minute: 1000}"))
    assert isinstance(await gate.check(chat(max_tokens=900)), Allow)
    d = denied(await gate.check(chat(max_tokens=900)), 429, "rate_limit_exceeded")
    assert d.reason == "tokens_per_minute"
    assert "team tier" in d.message and "tokens_per_minute=1000" in d.message
    assert_429_headers(d, "team", requests=False, tokens=True)
    assert d.headers["x-ratelimit-limit-tokens"] == "1000"


@pytest.mark.parametrize("limit", ["tokens_per_day", "tokens_per_month"])
async def test_token_quota_exhausted(limit: str) -> None:
    gate = Gate(policy(key_limits=f"{{{limit}: 1000}}"))
    assert isinstance(await gate.check(chat(max_tokens=900)), Allow)
    d = denied(await gate.check(chat(max_tokens=900)), 429, "insufficient_quota")
    assert d.reason == limit
    assert "key tier" in d.message and f"{limit}=1000" in d.message
    assert d.message.startswith("Quota exhausted")
    assert_429_headers(d, "key", requests=False, tokens=True)


async def test_a_spokes_share_of_a_global_quota_exhausted() -> None:
    """No allowance from the hub yet: the fallback share (10 % of 10,000)."""
    gate = Gate(policy(team_global="{tokens_per_day: 10000}"))
    assert isinstance(await gate.check(chat(max_tokens=900)), Allow)
    d = denied(await gate.check(chat(max_tokens=900)), 429, "insufficient_quota")
    assert d.reason == "global_tokens_per_day" and d.tier == "team"
    assert "team tier limit global_tokens_per_day=1000" in d.message
    assert "allowance of the tokens-per-day quota shared by all spokes" in d.message
    assert_429_headers(d, "team", requests=False, tokens=True)
    assert d.headers["x-ratelimit-limit-tokens"] == "1000"


async def test_team_denial_leaves_key_budget_untouched() -> None:
    gate = Gate(policy(team_limits="{rps: 1}", key_limits="{rps: 1}"))
    assert isinstance(await gate.check(chat("llama-3"), who="bob"), Allow)  # team cell used
    d = denied(await gate.check(chat()), 429, "rate_limit_exceeded")
    assert d.tier == "team"
    gate.clock.advance(1.0)  # the team refills; alice's key cell was never taken
    assert isinstance(await gate.check(chat()), Allow)


# --- 503: fail closed ----------------------------------------------------------------------------


async def test_store_unavailable_fails_closed() -> None:
    gate = Gate(policy(key_limits="{rps: 100}"), BrokenLimiter())
    d = denied(await gate.check(chat()), 503, "service_unavailable")
    assert gate.limiter.calls == 1
    # which of the two, never the store's own error (addresses, exception names): logged
    assert "cannot be reached" in d.message and "refused" not in d.message
    assert d.headers.get("retry-after") == "1"
    assert gate.ledger.stage("req-1") is None  # nothing was committed: nothing to undo


async def test_store_past_the_deadline_fails_closed_and_voids_the_admission() -> None:
    gate = Gate(policy(key_limits="{rps: 100}"), LateLimiter())
    d = denied(await gate.check(chat()), 503, "service_unavailable")
    assert "did not answer in time" in d.message and "250 ms" not in d.message
    assert gate.ledger.stage("req-1") is Stage.VOIDED  # it may commit later: voided


class Answers(CountingLimiter):
    """A store that answers every admission with one verdict."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__()
        self.verdict = verdict

    async def admit(self, req: AdmitRequest) -> Verdict:
        self.calls += 1
        return self.verdict


async def test_a_live_request_id_is_refused_as_a_duplicate() -> None:
    gate = Gate(policy(key_limits="{concurrency: 4}"), Answers(DuplicateId()))
    d = denied(await gate.check(chat()), 409, "duplicate_request_id")
    assert "already in flight" in d.message and gate.ledger.stage("req-1") is None


async def test_an_id_voided_moments_ago_is_refused_not_admitted() -> None:
    """A client reusing the id of a request the gateway gave up on (503) minutes ago."""
    gate = Gate(policy(key_limits="{concurrency: 4}"), Answers(Voided()))
    d = denied(await gate.check(chat()), 409, "duplicate_request_id")
    assert "given up" in d.message and gate.ledger.stage("req-1") is None


@pytest.mark.parametrize("verdict", [DuplicateId(), Voided()], ids=["live", "voided"])
async def test_a_duplicate_id_409_tells_the_sdks_not_to_retry(verdict: Verdict) -> None:
    """The OpenAI and Anthropic SDKs retry a 409 (a lock timeout, to them) with the same
    headers, so the same x-request-id: in vain while the other request runs (or for minutes
    after a void), and once it ended, admitted under its event id, which billing then drops
    as a duplicate."""
    gate = Gate(policy(key_limits="{concurrency: 4}"), Answers(verdict))
    d = denied(await gate.check(chat()), 409, "duplicate_request_id")
    assert d.headers.get("x-should-retry") == "false"


async def test_no_policy_denies_everything() -> None:
    gate = Gate(None)
    denied(await gate.check(chat()), 503, "service_unavailable")
    denied(await gate.check(chat(), who=None, headers={}), 503, "service_unavailable")
    assert gate.limiter.calls == 0


# --- answers: bodies and formats -------------------------------------------------------------


@pytest.mark.parametrize(("deny", "etype"), [
    (answers.unauthorized(), "invalid_request_error"),
    (answers.model_not_found("m"), "invalid_request_error"),
    (answers.model_not_allowed("m"), "invalid_request_error"),
    (answers.bad_request("bad"), "invalid_request_error"),
    (answers.unavailable("down"), "server_error"),
    (answers.limit_denial(Refused("key", "rps", 2.0, 0.5)), "requests"),
    (answers.limit_denial(Refused("team", "tokens_per_day", 10, 60)),
     "insufficient_quota"),
])
def test_error_body_is_openai_shaped(deny: Deny, etype: str) -> None:
    data = orjson.loads(answers.error_body(deny, "req-9"))
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err == {"message": deny.message, "type": etype, "param": None, "code": deny.code}
    assert isinstance(err["message"], str) and err["message"]


def test_limit_denial_rounds_retry_after_up() -> None:
    d = answers.limit_denial(Refused("team", "tokens_per_minute", 1000, 12.2))
    assert d.retry_after == 13 and d.headers["retry-after"] == "13"
    assert "Retry after 13s" in d.message
    tiny = answers.limit_denial(Refused("key", "rps", 100.0, 0.001))
    assert tiny.headers["retry-after"] == "1"  # never 0: a client would retry at once


def test_a_wait_past_a_minute_keeps_retry_after_and_says_not_to_retry() -> None:
    """The OpenAI SDKs honour retry-after only up to 60 s, the Anthropic SDK sleeps any:
    a spent day's quota (hours) must not block a call, nor be retried in vain."""
    day = answers.limit_denial(Refused("team", "tokens_per_day", 10, 7200.5))
    assert day.headers["retry-after"] == "7201" and day.retry_after == 7201
    assert day.headers["x-should-retry"] == "false" and "Retry after 7201s" in day.message
    minute = answers.limit_denial(Refused("key", "tokens_per_minute", 10, 60))
    assert minute.headers["retry-after"] == "60" and "x-should-retry" not in minute.headers
    assert answers.limit_denial(Refused("key", "rps", 10, 61)).headers["x-should-retry"] == \
        "false"


def test_rate_headers_of_allowed_responses() -> None:
    h = answers.rate_headers(RateInfo(10, 7, 0.25, 5000, 4000, 360.0))
    assert h == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "250ms",
        "x-ratelimit-limit-tokens": "5000",
        "x-ratelimit-remaining-tokens": "4000",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert answers.rate_headers(RateInfo()) == {}


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0ms"),
    (0.25, "250ms"),
    (0.0004, "1ms"),
    (1.0, "1s"),
    (1.2, "2s"),
    (59.0, "59s"),
    (60.0, "1m0s"),
    (360.0, "6m0s"),
    (361.5, "6m2s"),
    (3600.0, "1h0m0s"),
    (86399.0, "23h59m59s"),
    (-3.0, "0ms"),
])
def test_duration_format(seconds: float, text: str) -> None:
    assert answers.duration(seconds) == text


def test_a_reset_past_year_9999_is_the_last_instant_anthropic_headers_can_say() -> None:
    """A valid `rps` as small as 1e-12 (any float > 0 is a limit) makes its bucket whole
    again after more than 8,000 years: the Anthropic headers' RFC 3339 time raised
    OverflowError, and the Check of every such request failed."""
    from gateway.limits.types import RateInfo
    rate = RateInfo(req_limit=1, req_remaining=0, req_reset=1e300, tok_limit=5,
                    tok_remaining=0, tok_reset=1e12)
    out = answers.anthropic_rate_headers(rate, now=1_800_000_000.0)
    assert out["anthropic-ratelimit-requests-reset"] == "9999-12-31T23:59:59Z"
    assert out["anthropic-ratelimit-tokens-reset"] == "9999-12-31T23:59:59Z"


# --- no side door (gateway/routes.py) ------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/%63ompletions", "/v1//chat/completions",
                                  "/v1/x/../chat/completions", "/v1/chat%2Fcompletions"])
async def test_any_spelling_of_an_inference_path_gets_the_model_checks(path: str) -> None:
    gate = Gate(policy())
    denied(await gate.check(chat("mistral"), path=path), 403, "model_not_allowed")
    d = await gate.check(chat(), path=path)
    assert isinstance(d, Allow) and d.context.endpoint == "/v1/chat/completions"


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/messages/batches"), ("POST", "/v1/chat/completions/"),
    ("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"),
    ("POST", "/V1/CHAT/COMPLETIONS"), ("POST", "/health")])
async def test_unknown_routes_are_404_before_any_body_is_read_or_budget_spent(
        method: str, path: str) -> None:
    gate = Gate(policy(team_limits="{rps: 1}"))
    d = denied(await gate.check(chat("mistral"), path=path, method=method), 404, "unknown_url")
    assert d.key_id == "alice" and gate.limiter.calls == 0
    denied(await gate.check(chat(), path=path, method=method, who="nobody"),
           401, "invalid_api_key")


async def test_a_passthrough_body_naming_a_model_gets_the_model_checks() -> None:
    pol = load(policy(team_limits="{tokens_per_day: 100000}").doc.model_dump_json().replace(
        '"passthrough":[]', '"passthrough":[{"path":"/tokenize","methods":["POST"]}]'), 1)
    gate = Gate(pol)
    denied(await gate.check(chat("mistral"), path="/tokenize"), 403, "model_not_allowed")
    denied(await gate.check(chat("nope"), path="/tokenize"), 404, "model_not_found")
    denied(await gate.check({"model": 7}, path="/tokenize"), 400, "invalid_request_error")
    d = await gate.check(chat(max_tokens=5), path="/tokenize")
    assert isinstance(d, Allow) and d.context.caller.model == "qwen3-coder"
    assert d.context.reserved > 0
    d = await gate.check(b"not json", path="/tokenize")
    assert isinstance(d, Allow) and d.context.caller.model == "" and d.context.reserved == 0


@pytest.mark.parametrize("spell", [
    lambda m: b"\xef\xbb\xbf" + orjson.dumps(chat(m)),  # a UTF-8 BOM
    lambda m: json.dumps(chat(m)).encode("utf-16"),
    lambda m: orjson.dumps(chat(m))[:-1] + b', "temperature": NaN}',
    lambda m: orjson.dumps(chat(m))[:-1] + b', "x": "\\ud800"}',  # a lone surrogate escape
])
async def test_a_passthrough_body_the_engine_reads_as_json_gets_the_model_checks(
        spell: Any) -> None:
    # orjson refuses these bodies; the stdlib's json.loads, which FastAPI engines use,
    # reads each as naming its model: not a way around the model checks
    pol = load(policy().doc.model_dump_json().replace(
        '"passthrough":[]', '"passthrough":[{"path":"/tokenize","methods":["POST"]}]'), 1)
    gate = Gate(pol)
    denied(await gate.check(spell("mistral"), path="/tokenize"), 403, "model_not_allowed")
    denied(await gate.check(spell("nope"), path="/tokenize"), 404, "model_not_found")
    d = await gate.check(spell("qwen3-coder"), path="/tokenize")
    assert isinstance(d, Allow) and d.context.caller.model == "qwen3-coder"


async def test_a_passthrough_model_that_is_a_lone_surrogate_is_400() -> None:
    pol = load(policy().doc.model_dump_json().replace(
        '"passthrough":[]', '"passthrough":[{"path":"/tokenize","methods":["POST"]}]'), 1)
    d = await Gate(pol).check(b'{"model": "\\ud800"}', path="/tokenize")
    denied(d, 400, "invalid_request_error")


async def test_a_truncated_body_is_413_never_judged() -> None:
    # an Envoy with allow_partial_message: true sends the start of a body past its buffer,
    # flagged; cut, a pass-through body names no model and would skip the model checks
    pol = load(policy(team_limits="{rps: 1}").doc.model_dump_json().replace(
        '"passthrough":[]', '"passthrough":[{"path":"/tokenize","methods":["POST"]}]'), 1)
    gate = Gate(pol)
    cut = orjson.dumps(chat("mistral"))[:20]
    partial = {"authorization": f"Bearer {SECRETS['alice']}", "x-envoy-auth-partial-body": "true"}
    for path in ("/tokenize", "/v1/chat/completions"):
        d = denied(await gate.check(cut, path=path, headers=partial), 413, "request_too_large")
        assert d.key_id == "alice"
        assert orjson.loads(answers.error_body(d, "r"))["error"]["type"] == "invalid_request_error"
    d = denied(await gate.check(cut, path="/v1/messages", headers=partial), 413,
               "request_too_large")
    assert orjson.loads(answers.error_body(d, "r"))["error"]["type"] == "request_too_large"
    assert gate.limiter.calls == 0
    whole = {**partial, "x-envoy-auth-partial-body": "false"}
    assert isinstance(await gate.check(chat(), headers=whole), Allow)


# --- the ledger: admissions it follows, the concurrency grace ------------------------------


def alice(rid: str) -> AuthzRequest:
    return AuthzRequest(rid, "POST", "/v1/chat/completions",
                        {"authorization": f"Bearer {SECRETS['alice']}"},
                        json.dumps(chat()).encode())


async def test_an_admission_that_owes_its_end_is_entered_in_the_ledger() -> None:
    pol = policy(key_limits="{concurrency: 1}")
    lim = CountingLimiter()
    ledger = Ledger(lim, FakeClock(NOW), lease_ttl=30, watches=True)
    authz = Authorizer(lambda: pol, lim, FakeClock(NOW), ledger=ledger)
    assert isinstance(await authz.check(alice("r1")), Allow)
    assert ledger.stage("r1") is Stage.ADMITTED


async def test_abandon_voids_the_admission_in_the_ledger() -> None:
    """Envoy gave up on the Check after it admitted: the admission is undone."""
    pol = policy(key_limits="{concurrency: 1}")
    lim = CountingLimiter()
    ledger = Ledger(lim, FakeClock(NOW), lease_ttl=30)
    ledger.start()
    try:
        authz = Authorizer(lambda: pol, lim, FakeClock(NOW), ledger=ledger)
        assert isinstance(await authz.check(alice("r1")), Allow)
        authz.abandon("r1")
        assert ledger.stage("r1") is Stage.VOIDED
        await ledger.outbox.next_flush(1.0)
        assert "r1" not in lim.held  # its slot is free again, charged nothing
    finally:
        await ledger.stop()


async def test_a_concurrency_denial_waits_for_ends_on_their_way() -> None:
    """The slot's previous holder ended, but its release is still on its way (Envoy's
    record comes ~50 ms after the client saw the end): wait for it, not a 429."""
    pol = policy(key_limits="{concurrency: 1}")
    lim = CountingLimiter()
    ledger = Ledger(lim, FakeClock(NOW), lease_ttl=30, watches=True)
    ledger.start()
    try:
        authz = Authorizer(lambda: pol, lim, FakeClock(NOW),
                           AdmissionSettings(concurrency_grace_s=0.5), ledger=ledger)
        assert isinstance(await authz.check(alice("first")), Allow)
        asyncio.get_running_loop().call_later(0.02, ledger.released, "first")
        assert isinstance(await authz.check(alice("second")), Allow)
        assert lim.calls == 3  # the first, the second's denial, its retry after the release
    finally:
        await ledger.stop()


class SlowLimiter(CountingLimiter):
    """A store that answers, slowly (each call takes `delay`)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def admit(self, req: AdmitRequest) -> Verdict:
        await asyncio.sleep(self.delay)
        return await super().admit(req)


@pytest.mark.parametrize(("delay", "calls"), [(0.0, 3), (0.08, 2)],
                         ids=["one retry after the grace", "slow store: no retry"])
async def test_without_a_release_the_grace_ends_in_the_429(delay: float, calls: int) -> None:
    """One admission, one retry after the grace, nothing more. The grace is part of the
    Check's time, not added after a slow first answer: a first admission slower than the
    grace is not tried again, so a Check takes at most the grace plus one store deadline
    (350 ms on the defaults), inside Envoy's 0.5 s. It used to wait the grace after the
    first answer and retry: 250 + 100 + 250 ms at worst, and the client got Envoy's own
    timeout instead of the 429."""
    pol = policy(key_limits="{concurrency: 1}")
    lim = SlowLimiter(delay)
    ledger = Ledger(lim, FakeClock(NOW), lease_ttl=30)
    ledger.start()
    try:
        authz = Authorizer(lambda: pol, lim, FakeClock(NOW),
                           AdmissionSettings(concurrency_grace_s=0.05), ledger=ledger)
        assert isinstance(await authz.check(alice("a")), Allow)
        denied(await authz.check(alice("b")), 429, "rate_limit_exceeded")
        assert lim.calls == calls
    finally:
        await ledger.stop()


# --- truthful 429s (issue 11) ----------------------------------------------------------------


def test_error_type_says_tokens_or_requests_as_openai_does() -> None:
    def etype(d: Deny) -> str:
        return str(orjson.loads(answers.error_body(d, "r"))["error"]["type"])

    assert etype(answers.limit_denial(Refused("key", "rps", 2.0, 0.5))) == "requests"
    assert etype(answers.limit_denial(Refused("key", "concurrency", 4, 1))) == "requests"
    assert etype(answers.limit_denial(Refused("team", "tokens_per_minute", 9, 1))) == \
        "tokens"


def test_a_zero_limit_is_never_worth_retrying() -> None:
    d = answers.limit_denial(Refused("key", "tokens_per_day", 0, 3600), requested=50)
    assert "never pass" in d.message and d.retry_after is None
    assert "retry-after" not in d.headers and d.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(("where", "limit"), [
    ("key", "tokens_per_minute"), ("team", "tokens_per_day"), ("model", "tokens_per_month")])
async def test_a_request_larger_than_a_whole_window_is_impossible_at_every_tier(
        where: str, limit: str) -> None:
    """Refused as impossible, with both numbers and no retry-after, and nothing consumed."""
    spec = f"{{{limit}: 1234}}"
    gate = Gate(policy(**{f"{where}_limits": spec}))  # type: ignore[arg-type]
    d = denied(await gate.check(chat(max_tokens=4321)), 429,
               "insufficient_quota" if limit != "tokens_per_minute" else "rate_limit_exceeded")
    assert d.tier == where and d.retry_after is None
    assert "never pass" in d.message and f"{limit}=1234" in d.message
    assert "It needs 4326 tokens (prompt estimate 5 + completion 4321)" in d.message
    assert "retry-after" not in d.headers and d.headers["x-should-retry"] == "false"
    assert d.headers["x-ratelimit-limit-tokens"] == "1234"
    assert d.headers["x-ratelimit-remaining-tokens"] == "1234"  # it consumed nothing
    assert isinstance(await gate.check(chat(max_tokens=1000)), Allow)


async def test_the_reservation_cap_bounds_the_completion_never_the_prompt() -> None:
    """A 7 MiB prompt reserves all of its estimate; only max_tokens is capped."""
    huge = chat(max_tokens=10**9)
    huge["messages"][0]["content"] = "x" * (7 << 20)
    gate = Gate(policy(model_limits="{tokens_per_minute: 1000000}"))
    d = denied(await gate.check(huge), 429, "rate_limit_exceeded")
    assert d.tier == "model" and "never pass" in d.message
    prompt = (7 << 20 | 4) // 4 + 3 + 1  # ~4 chars a token (with "user"), 3 per message
    assert f"prompt estimate {prompt} + completion 32768" in d.message
    fits = Gate(policy(model_limits="{tokens_per_minute: 4000000}"))
    ok = await fits.check(huge)
    assert isinstance(ok, Allow) and ok.context.reserved == prompt + 32768


async def test_a_denial_carries_both_header_families_of_its_tier() -> None:
    """An rps 429 from a tier with a token limit says its tokens too, and a token 429 its
    requests: the numbers as they stand (the denial consumed nothing)."""
    gate = Gate(policy(key_limits="{rps: 1, burst: 1, tokens_per_minute: 5000}"))
    assert isinstance(await gate.check(chat(max_tokens=100)), Allow)
    d = denied(await gate.check(chat(max_tokens=100)), 429, "rate_limit_exceeded")
    assert d.reason == "rps"
    assert d.headers["x-ratelimit-limit-tokens"] == "5000"
    assert d.headers["x-ratelimit-remaining-tokens"] == str(5000 - 105)
    gate.clock.advance(1)
    denied(await gate.check(chat(max_tokens=4900)), 429, "rate_limit_exceeded")
    d = denied(await gate.check(chat(max_tokens=4900)), 429, "rate_limit_exceeded")
    assert d.reason == "tokens_per_minute"
    assert d.headers["x-ratelimit-limit-requests"] == "1"
    assert d.headers["x-ratelimit-remaining-requests"] == "1"


async def test_a_refused_known_key_is_named_on_its_denial() -> None:
    gate = Gate(policy())
    for who in ("old", "gone"):  # expired, disabled
        d = denied(await gate.check(chat(), who=who), 401, "invalid_api_key")
        assert d.key_id == who and d.team == "team-a"
    assert denied(await gate.check(chat(), who="nobody"), 401, "invalid_api_key").key_id == ""


# --- the limit named is the one that binds the wait ----------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize(("team", "key", "rps_tier", "quota_tier"), [
    ("{rps: 1}", "{tokens_per_day: 1000}", "team", "key"),  # rps at a tier checked first
    ("{}", "{rps: 1, tokens_per_day: 1000}", "key", "key"),  # rps checked first in a tier
])
async def test_the_429_names_the_limit_whose_wait_is_the_retry(
        path: str, team: str, key: str, rps_tier: str, quota_tier: str) -> None:
    """An rps refuses (1 s) and a day quota is spent (16 h to midnight UTC): the answer is
    the quota, its code, its numbers and its wait, not the rps checked before it and not a
    retry in 1 s (which would only be refused again)."""
    gate = Gate(policy(team_limits=team, key_limits=key))
    assert isinstance(await gate.check(chat(max_tokens=900), path=path), Allow)
    d = denied(await gate.check(chat(max_tokens=900), path=path), 429, "insufficient_quota")
    assert (d.tier, d.reason) == (quota_tier, "tokens_per_day")
    assert f"{quota_tier} tier limit tokens_per_day=1000" in d.message
    assert d.retry_after == 16 * 3600 and d.headers["retry-after"] == str(16 * 3600)
    assert d.headers["x-gateway-limit-tier"] == quota_tier
    assert d.headers["x-ratelimit-limit-tokens"] == "1000"
    assert d.rate is not None and d.rate.tok_reset == 16 * 3600
    # the rps alone (a request that fits the quota) is still the rps, waiting 1 s
    d = denied(await gate.check(chat(max_tokens=1), path=path), 429, "rate_limit_exceeded")
    assert (d.tier, d.reason, d.retry_after) == (rps_tier, "rps", 1)


async def test_equal_waits_keep_the_order_of_evaluation() -> None:
    """Two day quotas spent, each waiting for midnight: the first tier checked is named."""
    gate = Gate(policy(team_limits="{tokens_per_day: 1000}", key_limits="{tokens_per_day: 1000}"))
    assert isinstance(await gate.check(chat(max_tokens=900)), Allow)
    d = denied(await gate.check(chat(max_tokens=900)), 429, "insufficient_quota")
    assert (d.tier, d.reason) == ("team", "tokens_per_day")


# --- count_tokens: free of the token windows, not of rps and concurrency ------------------------


COUNT = "/v1/messages/count_tokens"


async def spent_day(key_limits: str = "{}") -> Gate:
    """alice's team has used its whole day: 1000 of 1000 tokens."""
    gate = Gate(policy(team_limits="{tokens_per_day: 1000}", key_limits=key_limits))
    d = await gate.check(chat(max_tokens=10))
    assert isinstance(d, Allow)
    await gate.limiter.settle(d.context.request_id, 1000)
    return gate


async def test_count_tokens_passes_a_spent_token_window() -> None:
    gate = await spent_day()
    d = await gate.check(chat(), path=COUNT)
    assert isinstance(d, Allow), d
    assert d.context.reserved == 0 and not d.context.leased  # holds nothing, owes nothing
    assert d.rate.tok_limit is None  # no token window was looked at
    assert (await gate.limiter.counters("team:team-a", NOW)).day == 1000  # nor counted


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", chat(max_tokens=0)),
    ("/v1/chat/completions", chat(max_completion_tokens=0)),
    ("/v1/messages", chat(max_tokens=0)),
    ("/v1/completions", {"model": "qwen3-coder", "prompt": "hi", "max_tokens": 0}),
    ("/v1/responses", {"model": "qwen3-coder", "input": "hi", "max_output_tokens": 0}),
    ("/v1/embeddings", {"model": "qwen3-coder", "input": "hi"}),
    ("/v1/chat/completions", {"model": "qwen3-coder", "messages": [], "max_tokens": 0}),
])
async def test_no_side_door_a_request_that_reserves_little_or_nothing_is_still_refused(
        path: str, body: dict[str, Any]) -> None:
    """Only an endpoint that bills no tokens by its nature is free of the token windows: a
    completion capped at 0 still has a prompt to bill, an embedding too."""
    gate = await spent_day()
    d = denied(await gate.check(body, path=path), 429, "insufficient_quota")
    assert d.reason == "tokens_per_day"


async def test_count_tokens_is_still_held_to_rps_and_concurrency() -> None:
    gate = await spent_day("{rps: 1}")
    gate.clock.advance(1.0)
    assert isinstance(await gate.check(chat(), path=COUNT), Allow)
    d = denied(await gate.check(chat(), path=COUNT), 429, "rate_limit_exceeded")
    assert (d.tier, d.reason) == ("key", "rps")
    assert d.rate is not None and d.rate.tok_limit is None
    busy = Gate(policy(key_limits="{concurrency: 1}"))
    assert isinstance(await busy.check(chat(max_tokens=10)), Allow)
    d = denied(await busy.check(chat(), path=COUNT), 429, "rate_limit_exceeded")
    assert d.reason == "concurrency"


@pytest.mark.parametrize("rid", ["r\x1f1", "\x1eticket", "r\n1", "r\x7f"],
                         ids=["unit-separator", "ticket-prefix", "newline", "del"])
async def test_a_request_id_with_a_control_character_is_refused_before_the_store(
        rid: str) -> None:
    """The admission scripts join a request's fields with \\x1f, and an id that starts with
    \\x1e is a ticket (gateway/limits/ahead.py): an id "r\\x1f1" failed admit.lua for its
    whole batch (every request in it answered 503, those before it committed all the same),
    so such an id is a bad request, as a missing one is. Envoy 1.40 refuses such a header
    itself (400); a Check from another caller may carry one."""
    gate = Gate(policy(key_limits="{concurrency: 4}"))
    h = {"authorization": f"Bearer {SECRETS['alice']}"}
    d = await gate.authz.check(AuthzRequest(rid, "POST", "/v1/chat/completions", h,
                                            json.dumps(chat()).encode()))
    assert "x-request-id" in denied(d, 400, "invalid_request_error").message
    assert gate.limiter.calls == 0
