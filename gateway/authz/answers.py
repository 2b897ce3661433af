"""The HTTP answers a client sees (DESIGN §4): errors and rate-limit headers in the shape
the route's clients expect: OpenAI's, or Anthropic's on the Messages API, so each SDK raises
its own typed errors."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime

import orjson

from gateway.authz.decision import Deny, Reply
from gateway.endpoints import Api
from gateway.envoy_contract import (
    ANTHROPIC_REQUEST_ID,
    CONTEXT_PREFIX,
    CREDENTIALS,
)
from gateway.limits.types import (
    CONCURRENCY,
    GTPD,
    GTPMO,
    RPS,
    TPD,
    TPM,
    TPMO,
    RateInfo,
    Refused,
)
from gateway.metering.handoff import DUPLICATE_ID
from gateway.token_weights import TokenWeights

# error.type per error.code, as OpenAI uses them, so SDKs map them to their usual exceptions.
ERROR_TYPES = {
    "invalid_api_key": "invalid_request_error",
    "model_not_found": "invalid_request_error",
    "model_not_allowed": "invalid_request_error",
    "invalid_request_error": "invalid_request_error",
    "unknown_url": "invalid_request_error",
    "duplicate_request_id": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "rate_limit_exceeded": "requests",
    "insufficient_quota": "insufficient_quota",
    "service_unavailable": "server_error",
}


# Anthropic's documented error.type per HTTP status (its API reference, "Errors"; its SDK
# picks the exception by status). 503 is not among them: `overloaded_error` is Anthropic's
# 529, its whole API short of capacity, not this gateway's limiter store or spool away.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """A status the table lacks: `invalid_request_error` below 500 (the docs use it "for
    other 4XX status codes not listed"), `api_error` from 500 up (the gateway's 503)."""
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(deny: Deny, request_id: str) -> bytes:
    if deny.api is Api.ANTHROPIC:
        return orjson.dumps({"type": "error", "error": {
            "type": anthropic_error_type(deny.status), "message": deny.message},
            "request_id": request_id})
    err = {
        "message": deny.message,
        "type": deny.error_type or ERROR_TYPES.get(deny.code, "invalid_request_error"),
        "param": None,
        "code": deny.code,
    }
    return orjson.dumps({"error": err, "request_id": request_id})


def duration(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '250ms'."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    if s < 60:
        return f"{s}s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m}m{sec}s" if h else f"{m}m{sec}s"


def rate_headers(rate: RateInfo) -> dict[str, str]:
    out = {}
    if rate.req_limit is not None:
        out["x-ratelimit-limit-requests"] = str(rate.req_limit)
        out["x-ratelimit-remaining-requests"] = str(rate.req_remaining or 0)
        out["x-ratelimit-reset-requests"] = duration(rate.req_reset or 0.0)
    if rate.tok_limit is not None:
        out["x-ratelimit-limit-tokens"] = str(rate.tok_limit)
        out["x-ratelimit-remaining-tokens"] = str(rate.tok_remaining or 0)
        out["x-ratelimit-reset-tokens"] = duration(rate.tok_reset or 0.0)
    return out


_LAST_SECOND = 253_402_300_799  # 9999-12-31T23:59:59Z: a reset past it (an rps of 1e-12) says it


def anthropic_rate_headers(rate: RateInfo, now: float | None = None) -> dict[str, str]:
    """Anthropic's anthropic-ratelimit-* headers, resets as RFC 3339 times. The gateway's
    token limits count input and output together (weighted, for a model with
    token_weights): the input- and output-tokens headers repeat that one budget, the most
    either may use."""
    now = time.time() if now is None else now

    def at(seconds: float | None) -> str:  # no later than RFC 3339's last second
        t = datetime.fromtimestamp(min(math.ceil(now + (seconds or 0.0)), _LAST_SECOND), UTC)
        return t.strftime("%Y-%m-%dT%H:%M:%SZ")

    out = {}
    if rate.req_limit is not None:
        out["anthropic-ratelimit-requests-limit"] = str(rate.req_limit)
        out["anthropic-ratelimit-requests-remaining"] = str(rate.req_remaining or 0)
        out["anthropic-ratelimit-requests-reset"] = at(rate.req_reset)
    if rate.tok_limit is not None:
        for kind in ("tokens", "input-tokens", "output-tokens"):
            out[f"anthropic-ratelimit-{kind}-limit"] = str(rate.tok_limit)
            out[f"anthropic-ratelimit-{kind}-remaining"] = str(rate.tok_remaining or 0)
            out[f"anthropic-ratelimit-{kind}-reset"] = at(rate.tok_reset)
    return out


def removed_headers(request_headers: Iterable[str], keeps: frozenset[str]) -> list[str]:
    """What an allowed request loses before the engine: the credentials, and a client's own
    x-gateway-* headers (forged context) but those in `keeps`, which ours overwrite: its
    Caller's (`Caller.keeps`), so a context header the gateway does not set on this request
    (no model, no objective) is removed too, never left with the client's value."""
    return [*CREDENTIALS, *(h for h in request_headers
                            if h.startswith(CONTEXT_PREFIX) and h not in keeps)]


def allowed_headers(rate: RateInfo, api: Api, request_id: str = "") -> dict[str, str]:
    """The headers an allowed response gets: its rate-limit headers, and on Anthropic's API
    its `request-id` (ANTHROPIC_REQUEST_ID)."""
    if api is not Api.ANTHROPIC:
        return rate_headers(rate)
    return {**anthropic_rate_headers(rate), **_request_id(request_id)}


def denial_headers(deny: Deny, request_id: str = "") -> dict[str, str]:
    """A denial's headers, in its API's shape (`deny.headers` holds OpenAI's)."""
    if deny.api is not Api.ANTHROPIC:
        return deny.headers
    out = {k: v for k, v in deny.headers.items() if not k.startswith("x-ratelimit-")}
    if deny.rate is not None:
        out.update(anthropic_rate_headers(deny.rate))
    out.update(_request_id(request_id))
    return out


def _request_id(request_id: str) -> dict[str, str]:
    """Anthropic's API answers with a `request-id` header, which its SDK hands out as a
    message's `_request_id` and an error's `request_id` (OpenAI's reads x-request-id, which
    Envoy sets on every answer): the gateway's is the same id, the usage event's."""
    return {ANTHROPIC_REQUEST_ID: request_id} if request_id else {}


_LIMIT_WORDS = {
    RPS: "requests per second",
    CONCURRENCY: "concurrent requests",
    TPM: "tokens per minute",
    TPD: "tokens per day",
    TPMO: "tokens per month",
    GTPD: "this spoke's allowance of the tokens-per-day quota shared by all spokes",
    GTPMO: "this spoke's allowance of the tokens-per-month quota shared by all spokes",
}


# A wait longer than this is not for an SDK's automatic retry: the OpenAI SDKs honour a
# retry-after only up to 60 s (past it they retry in vain after a short backoff), and the
# Anthropic SDK (2.x) sleeps whatever it says, a quota's hours to midnight included.
SDK_RETRY_MAX_S = 60


def limit_denial(v: Refused, requested: int = 0, prompt: int | None = None,
                 weights: TokenWeights | None = None, completion: int = 0) -> Deny:
    """A 429 naming the tier and the limit, with retry-after and the x-ratelimit-* headers.

    A request that can never pass (the limit is 0, or it asks for more tokens than the
    window's whole limit: `v.impossible`) is told so, with the numbers, and not to retry:
    no retry-after, and `x-should-retry: false`, which the OpenAI SDKs obey instead of
    retrying in vain. One that must wait longer than SDK_RETRY_MAX_S (a spent daily or
    monthly quota) keeps its retry-after, for the client to schedule, and says
    `x-should-retry: false` too, so no SDK blocks a call for hours or retries in vain.
    `requested` is its reservation, `prompt` the prompt's share of it; with the model's
    token `weights`, `requested` is in weighted tokens (gateway/token_weights.py), and it
    says so, with the raw prompt estimate and `completion` bound it weighs.
    """
    quota = v.limit in (TPD, TPMO, GTPD, GTPMO)
    tokens = quota or v.limit == TPM
    retry = max(1, math.ceil(v.retry_after))
    value = v.limit_value
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    never = value == 0 or v.impossible
    what = f"{v.tier} tier limit {v.limit}={shown} ({_LIMIT_WORDS[v.limit]})"
    if never:
        oversize = ""
        if tokens and v.impossible:
            if weights is not None:
                top = max(weights.input, weights.cached_input, weights.cache_creation)
                parts = (f"prompt estimate {prompt or 0} x {top:g} + completion {completion} x "
                         f"{weights.output:g}: the model's token_weights, the prompt at its "
                         "largest input weight")
                need = f"{requested} weighted tokens"
            else:
                parts = (f"prompt estimate {prompt} + completion {requested - prompt}"
                         if prompt is not None else "prompt estimate + completion")
                need = f"{requested} tokens"
            oversize = (f" It needs {need} ({parts}), more than the whole limit "
                        f"of {shown}: lower max_tokens or shorten the prompt.")
        message = f"This request can never pass: {what}.{oversize} Retrying will not help."
        headers = {"x-should-retry": "false", "x-gateway-limit-tier": v.tier}
    else:
        message = (f"{'Quota exhausted' if quota else 'Rate limit exceeded'}: {what}."
                   f" Retry after {retry}s.")
        headers = {"retry-after": str(retry), "x-gateway-limit-tier": v.tier}
        if retry > SDK_RETRY_MAX_S:
            headers["x-should-retry"] = "false"
    rate = v.rate
    if v.limit == CONCURRENCY and rate.req_limit is None and value is not None:
        rate = replace(rate, req_limit=int(value), req_remaining=0, req_reset=v.retry_after)
    headers.update(rate_headers(rate))
    return Deny(
        status=429,
        code="insufficient_quota" if quota else "rate_limit_exceeded",
        message=message,
        reason=v.limit,
        tier=v.tier,
        retry_after=None if never else retry,
        rate=rate,
        headers=headers,
        error_type="insufficient_quota" if quota else "tokens" if tokens else "requests",
    )


def unauthorized(message: str = "Invalid API key.") -> Deny:
    return Deny(401, "invalid_api_key", message, "invalid_api_key")


def bad_request(message: str) -> Deny:
    return Deny(400, "invalid_request_error", message, "invalid_request")


def partial_body() -> Deny:
    """Envoy sent only the start of the body (an `allow_partial_message: true` filter, not
    ours): as Envoy's own 413 for a body past its buffer, never a judgement on a truncated
    prompt (a cut JSON body names no model, which would pass the model checks by)."""
    return Deny(413, "request_too_large",
                "Request body too large: the gateway received only part of it.",
                "request_too_large")


def encoded_body(encoding: str) -> Deny:
    """A body sent with a Content-Encoding (gzip...): the Check cannot read the model it
    names, and an engine that decompresses requests would (no side door)."""
    return Deny(415, "unsupported_content_encoding",
                f"Content-Encoding {encoding[:40]!r} is not accepted; send the body "
                "uncompressed.", "unsupported_content_encoding")


# The OpenAI and Anthropic SDKs retry a 409 (a lock timeout, to them) with the same headers:
# the same id, refused again, or once the other request ended admitted under its event id,
# which billing drops as a duplicate. `x-should-retry: false` they obey.
_NO_RETRY = {"x-should-retry": "false"}


def duplicate_request_id(request_id: str) -> Deny:
    """Another request with this x-request-id is in flight (an Envoy that keeps client ids):
    one id, one admission, one usage event. No event of its own: the id is the other's."""
    return Deny(409, "duplicate_request_id",
                f"A request with x-request-id {request_id[:80]!r} is already in flight; "
                "send each request with its own id.", DUPLICATE_ID, headers=dict(_NO_RETRY))


def voided_request_id(request_id: str) -> Deny:
    """An admission with this x-request-id was voided moments ago (the gateway gave up
    waiting for its store, and answered 503): the id is not admitted again for minutes."""
    return Deny(409, "duplicate_request_id",
                f"A request with x-request-id {request_id[:80]!r} was given up moments ago; "
                "send each request with its own id.", DUPLICATE_ID, headers=dict(_NO_RETRY))


def model_not_found(model: str) -> Deny:
    return Deny(404, "model_not_found", f"The model '{model}' does not exist.", "model_not_found")


def model_not_allowed(model: str) -> Deny:
    return Deny(403, "model_not_allowed",
                f"This API key is not allowed to use the model '{model}'.", "model_not_allowed")


def unknown_url(method: str, path: str) -> Deny:
    """A path the gateway does not know: refused whatever the body says (no side door)."""
    return Deny(404, "unknown_url", f"Invalid URL ({method} {path[:200]}).", "unknown_url")


def model_object(model: str, key_id: str, team: str) -> Reply:
    return Reply(200, orjson.dumps(_model(model)), key_id, team, model)


def models_list(models: list[str], key_id: str, team: str) -> Reply:
    """GET /v1/models, answered from the policy: the models this key may use."""
    return Reply(200, orjson.dumps({"object": "list", "data": [_model(m) for m in models]}),
                 key_id, team)


def _model(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "gateway"}


def unavailable(message: str, reason: str = "store_unavailable") -> Deny:
    return Deny(503, "service_unavailable", message, reason, headers={"retry-after": "1"})


def usage_unrecordable(why: str) -> Deny:
    """The spool cannot write (disk full, read-only, EIO): a new request's usage could not
    be recorded, so it is refused as a down limiter store refuses it (fails closed)."""
    return unavailable(f"Usage cannot be recorded (usage spool not writable: {why}); failing "
                       "closed.", "spool_unwritable")
