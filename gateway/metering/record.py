"""Envoy's one record per request (GATEWAY_METERING=envoy), read into the facts of its event.

Sans-I/O: the logs service hands over the record's attributes, as the access-log formatter
rendered them (gateway/envoyconf/metering.py RECORD_ATTRIBUTES: all strings, "-" when empty,
metadata namespaces as JSON). What ext_proc learns chunk by chunk, Envoy's filters have
put in the record: usage from the Lua filter / json_to_metadata, content counters from
the Lua filter, the status, the response flags and the timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.endpoints import Reader, reader_of
from gateway.envoy_contract import CLIENT_FLAGS, PERIODIC, UPSTREAM_FLAGS
from gateway.metering import handoff
from gateway.metering.handoff import RequestFacts
from gateway.metering.meter import Result
from gateway.metering.usage import Usage, from_messages


class Unreadable(ValueError):
    """A record whose Check facts cannot be read: its request is billed as an orphan."""


@dataclass(frozen=True, slots=True)
class Record:
    request_id: str
    facts: RequestFacts
    result: Result
    status: int
    outcome: str
    started: float  # epoch seconds
    ended: float
    source: str


def _json(text: str | None) -> dict[str, Any]:
    if not text or text == "-":
        return {}
    try:
        v = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}
    return v if isinstance(v, dict) else {}


def _num(text: str | None) -> float | None:
    if not text or text == "-":
        return None
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _int(v: Any) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else 0


def flags_of(attrs: dict[str, str]) -> frozenset[str]:
    """%RESPONSE_FLAGS% as a set ("-" when none)."""
    return frozenset((attrs.get("flags") or "-").split(","))


def request_id(attrs: dict[str, str]) -> str | None:
    rid = attrs.get("rid", "-")
    return None if not rid or rid == "-" else rid


def is_heartbeat(attrs: dict[str, str]) -> bool:
    return attrs.get("type") == PERIODIC


def read(attrs: dict[str, str]) -> Record | None:
    """One record; None if it names no request (nothing to bill it to). Raises Unreadable
    (or anything) when it names one but its Check facts are garbled."""
    rid = request_id(attrs)
    if rid is None:
        return None
    text = attrs.get("authz")
    authz = _json(text)
    if not authz and text not in (None, "", "-", "{}"):
        raise Unreadable(f"ext_authz metadata is not a JSON object: {text[:80]!r}")
    facts = handoff.read(authz, attrs.get("path", ""), rid)
    if facts.duplicate:
        return None  # its id is a live request's: that one's record bills it
    status = int(_num(attrs.get("code")) or 0)
    flags = flags_of(attrs)
    counted = _json(attrs.get("counted"))
    usage = _json(attrs.get("usage"))
    started = _num(attrs.get("start")) or 0.0
    duration_us = _num(attrs.get("duration_us"))
    if duration_us is None:  # a cut stream never sent its last byte: its whole life
        duration_us = (_num(attrs.get("total_ms")) or 0.0) * 1000
    duration_s = duration_us / 1e6

    if facts.denied_status or not facts.key_id:
        outcome = "denied"  # ext_authz said no, or Envoy answered itself (413, 503, ...)
        status = facts.denied_status or status
    elif flags & UPSTREAM_FLAGS or status >= 500 or counted.get("failed") is True:
        outcome = "upstream_error"
    elif flags & CLIENT_FLAGS and counted.get("done") is not True:
        outcome = "client_cancelled"
    else:
        outcome = "completed"

    result, source = _result(facts, status, usage, counted, outcome, attrs)
    return Record(rid, facts, result, status, outcome, started, started + duration_s, source)


def checkpoint(attrs: dict[str, str]) -> tuple[int, int] | None:
    """A heartbeat record's usage so far (prompt, completion), as its end would bill it."""
    rec = read(attrs)
    if rec is None or rec.outcome == "denied":
        return None
    u = rec.result.usage
    return u.prompt_tokens, u.completion_tokens


def _result(facts: RequestFacts, status: int, usage: dict[str, Any], counted: dict[str, Any],
            outcome: str, attrs: dict[str, str]) -> tuple[Result, str]:
    served = usage.get("model")
    served_model = served if isinstance(served, str) else ""
    ttft_us = _num(attrs.get("ttft_us"))
    gen_us = _num(attrs.get("gen_us"))
    if outcome == "denied":
        return Result(Usage(), "reported", served_model, 0.0, 0.0), "reported"
    events, chars = _int(counted.get("content_events")), _int(counted.get("content_chars"))
    completion = max(events, math.ceil(chars / 4))
    messages = reader_of(facts.endpoint) is Reader.MESSAGES
    if messages and "completion_tokens" in usage:  # message_delta, or a whole answer
        u = from_messages({  # the Lua/json_to_metadata keys in Anthropic's names
            "input_tokens": _int(usage.get("prompt_tokens")),
            "output_tokens": _int(usage.get("completion_tokens")),
            **{k: _int(usage.get(k)) for k in ("cache_read_input_tokens",
                                              "cache_creation_input_tokens")}}) or Usage()
        source = "reported"
    elif messages and "prompt_tokens" in usage:  # only message_start: the input side is exact
        u = from_messages({  # its cache counts included; the output estimated from what streamed
            "input_tokens": _int(usage.get("prompt_tokens")), "output_tokens": completion,
            **{k: _int(usage.get(k)) for k in ("cache_read_input_tokens",
                                              "cache_creation_input_tokens")}}) or Usage()
        source = "estimated"
    elif "prompt_tokens" in usage or "completion_tokens" in usage:
        p, c = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
        u = Usage(p, c, _int(usage.get("total_tokens")) or p + c,
                  _int(usage.get("cached_tokens")), _int(usage.get("reasoning_tokens")))
        source = "reported"
    elif status >= 400 and not completion:
        u, source = Usage(), "reported"  # an error answer: nothing was generated
    else:
        prompt = facts.prompt_estimate if status or completion else 0
        u, source = Usage(prompt, completion, prompt + completion), "estimated"
    ttft = ttft_us / 1000 if ttft_us is not None else 0.0
    tpot = 0.0
    if facts.stream and gen_us is not None and u.completion_tokens > 1:
        tpot = gen_us / 1000 / (u.completion_tokens - 1)
    return Result(u, source, served_model, ttft, tpot, completion), source
