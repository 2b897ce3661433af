"""The ext_authz → metering contract: what the Check hands over, and how it is read back.

The Check's verdict reaches metering three ways, all through this module: as Envoy dynamic
metadata (a Struct under envoy_contract.AUTHZ_NAMESPACE, forwarded on every ext_proc
message), as the same Struct rendered to JSON in Envoy's per-request record, and, for an
admission nobody settled, as the `meta` string the limiter stores with it (read back by the
orphan sweep).
The Lua filter (gateway/envoyconf/lua/metering.lua) reads the splice keys under the same names
(gateway/envoy_contract.py's). Writer and readers share the key names here, so they cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from gateway.envoy_contract import (
    HIDE_CONTINUOUS,
    HIDE_USAGE,
    METERED,
    SPLICE,
    SPLICE_AT,
    SPLICE_CUT,
    TOKEN_WEIGHTS,
)
from gateway.metering.inject import Injected, Splice
from gateway.policy.billing_rules import DEFAULT_CANCEL_RULE, CancelRule, rule_of
from gateway.token_weights import TokenWeights

DUPLICATE_ID = "duplicate_request_id"  # the denial reason of a request id already in flight

# Every key written here is one of envoy_contract.METADATA_KEYS (the HTTP door sends each as
# a header of that name).
Metadata = dict[str, str | int | bool]


@dataclass
class RequestFacts:
    """What ext_authz decided, forwarded by Envoy as metadata: the only context trusted."""

    request_id: str = ""
    key_id: str = ""
    team: str = ""
    model: str = ""
    endpoint: str = ""
    stream: bool = False
    leased: bool = False
    prompt_estimate: int = 0
    stream_options: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    denied_status: int = 0
    # Refused because another request with this id is in flight: the id, and so the usage
    # event's id, is that request's; this one gets no event of its own (README).
    duplicate: bool = False
    # The Check emitted its event itself (`metered`): a stream or record of it emits none
    metered: bool = False
    traceparent: str = ""  # the W3C trace context of a traced request
    splice: Splice | None = None  # what the Check planned to splice into the request
    cancelled: CancelRule = DEFAULT_CANCEL_RULE  # the team's billing rule, as admitted
    # The model's token weights, as admitted; None: its tokens count raw toward the limits
    weights: TokenWeights | None = None


# -- written by the Check (gateway/authz/check.py) ----------------------------------------

def allowed(request_id: str, reserved: int, prompt_estimate: int, traceparent: str = "",
            splice: Splice | None = None) -> Metadata:
    """An allowed request's own entries (the rest: `caller`)."""
    md: Metadata = {"request_id": request_id, "reserved": reserved,
                    "prompt_estimate": prompt_estimate}
    if traceparent:
        md["traceparent"] = traceparent
    if splice is not None:  # applied by the Lua filter, or by ext_proc
        md[SPLICE] = splice.insert.decode()
        md[SPLICE_AT] = splice.at
        md[SPLICE_CUT] = splice.cut
        md[HIDE_USAGE] = splice.injected.include_usage
        md[HIDE_CONTINUOUS] = splice.injected.continuous
    return md


def caller(key_id: str, team: str, model: str, endpoint: str, stream: bool, leased: bool,
           stream_options: bool, include_usage: bool, continuous_usage: bool,
           cancelled: CancelRule = DEFAULT_CANCEL_RULE,
           weights: TokenWeights | None = None) -> Metadata:
    """An allowed request's entries that repeat for every request of a caller and request
    shape (the Check builds and encodes them once: gateway/authz/decision.py Shared).
    `cancelled`: how the team bills a stream its client cancels
    (gateway/policy/billing_rules.py), fixed at admission. `weights`: the model's token
    weights, an entry only when it has some (a model without them: the same entries as
    before weights existed)."""
    md: Metadata = {"key_id": key_id, "team": team, "model": model, "stream": stream,
                    "leased": leased, "endpoint": endpoint, "stream_options": stream_options,
                    "include_usage": include_usage, "continuous_usage": continuous_usage,
                    "cancelled": cancelled}
    if weights is not None:
        md[TOKEN_WEIGHTS] = weights.text()
    return md


def denied(request_id: str, reason: str, status: int, key_id: str, team: str, model: str,
           endpoint: str, traceparent: str = "", stream: bool = False) -> Metadata:
    """A denial: `denied` (the reason) marks it, `status` is what the client got."""
    md: Metadata = {"request_id": request_id, "denied": reason, "status": status,
                    "key_id": key_id, "team": team, "model": model, "endpoint": endpoint,
                    "stream": stream}
    if traceparent:
        md["traceparent"] = traceparent
    return md


def replied(request_id: str, key_id: str, team: str, model: str, endpoint: str,
            traceparent: str = "") -> Metadata:
    """The gateway's own answer: names the caller, without `denied` (a completed request
    that cost no tokens)."""
    md: Metadata = {"request_id": request_id, "key_id": key_id, "team": team, "model": model,
                    "endpoint": endpoint}
    if traceparent:
        md["traceparent"] = traceparent
    return md


def metered(md: Metadata) -> None:
    """Mark a local reply's metadata: the Check emitted its event itself
    (Recorder.answered_without_body)."""
    md[METERED] = True


# -- read by metering (ext_proc, or Envoy's record) ----------------------------------------

def read(md: Mapping[str, object], path: str = "", request_id: str = "") -> RequestFacts:
    """The facts from the metadata as plain values (a Struct's, or the record's JSON).
    A value of the wrong type reads as absent (flags and numbers may be strings: the HTTP
    door's metadata); `request_id` and `path` (Envoy's own) fill in what a Check that never
    answered could not say."""
    def text(k: str) -> str:
        v = md.get(k)
        return v if isinstance(v, str) else ""

    def flag(k: str) -> bool:  # true, or "true" (the HTTP door's metadata are strings)
        v = md.get(k)
        return v is True or v == "true"

    def num(k: str) -> int:  # a number, or its decimal string
        v = md.get(k)
        if isinstance(v, str) and v.isascii() and v.isdigit():
            return int(v)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else 0

    return RequestFacts(
        request_id=text("request_id") or request_id, key_id=text("key_id"), team=text("team"),
        model=text("model"), endpoint=text("endpoint") or path.partition("?")[0],
        stream=flag("stream"), leased=flag("leased"), prompt_estimate=num("prompt_estimate"),
        stream_options=flag("stream_options"), include_usage=flag("include_usage"),
        continuous_usage=flag("continuous_usage"),
        denied_status=num("status") if "denied" in md else 0,
        duplicate=md.get("denied") == DUPLICATE_ID,
        metered=flag(METERED),
        traceparent=text("traceparent"),
        splice=Splice(num(SPLICE_AT), num(SPLICE_CUT), text(SPLICE).encode(),
                      Injected(flag(HIDE_USAGE), flag(HIDE_CONTINUOUS)))
        if SPLICE in md else None,
        cancelled=rule_of(md.get("cancelled")),
        weights=TokenWeights.parse(text(TOKEN_WEIGHTS)) if TOKEN_WEIGHTS in md else None,
    )


# -- stored with an admission, read by the orphan sweep ------------------------------------

def orphan_meta(key_id: str, team: str, model: str, endpoint: str, stream: bool) -> str:
    """Who and what, for the event of a request nobody settles. A positional JSON array:
    records already in Redis are written so, keep it readable across versions."""
    return orjson.dumps([key_id, team, model, endpoint, stream]).decode()


def orphan_facts(request_id: str, meta: str) -> RequestFacts:
    try:
        key_id, team, model, endpoint, stream = orjson.loads(meta)
    except (orjson.JSONDecodeError, ValueError, TypeError):
        key_id = team = model = endpoint = ""
        stream = False
    return RequestFacts(request_id=request_id, key_id=key_id, team=team, model=model,
                        endpoint=endpoint, stream=bool(stream))
