"""Envoy's one record per request (GATEWAY_METERING=envoy), read into the request's facts.

Sans-I/O: the logs service hands over the record's attributes, as the access-log formatter
rendered them (gateway/envoy_contract.py RECORD_ATTRIBUTES: all strings, "-" when empty,
metadata namespaces as JSON). What ext_proc learns chunk by chunk, Envoy's filters have
put in the record: usage from the Lua filter / json_to_metadata, content counters from
the Lua filter, the status, the response flags and the timings. They are read into the
same `ResponseFacts` ext_proc's Meter gives; what is billed is decided from those, once
(gateway/metering/billing.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway import envoy_contract as c
from gateway.endpoints import ENDPOINTS, Reader, reader_of
from gateway.metering import handoff
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.metering.usage import anthropic, count
from gateway.usage_event import Usage


class Unreadable(ValueError):
    """A record whose Check facts cannot be read: its request is billed as an orphan."""


@dataclass(slots=True)  # not frozen: that costs µs a record (treated as immutable all the same)
class Record:
    request_id: str
    facts: RequestFacts
    response: ResponseFacts
    started: float  # epoch seconds
    ended: float


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


def flags_of(attrs: dict[str, str]) -> frozenset[str]:
    """%RESPONSE_FLAGS% as a set (empty when none: "-")."""
    text = attrs.get(c.REC_FLAGS) or "-"
    return frozenset() if text == "-" else frozenset(text.split(","))


def status_of(attrs: dict[str, str]) -> int:
    """%RESPONSE_CODE% (0: none was sent)."""
    return int(_num(attrs.get(c.REC_CODE)) or 0)


def request_id(attrs: dict[str, str]) -> str | None:
    rid = attrs.get(c.REC_ID, "-")
    return None if not rid or rid == "-" else rid


def unanswered_check(attrs: dict[str, str]) -> bool:
    """Whether Envoy answered this request itself because its Check failed (the sidecar
    down or slower than the timeout): no Check's word (metadata) in the record, and Envoy's
    details say so."""
    return (attrs.get(c.REC_DETAILS) == c.AUTHZ_ERROR_DETAILS
            and attrs.get(c.REC_AUTHZ) in (None, "", "-", "{}"))


def is_heartbeat(attrs: dict[str, str]) -> bool:
    return attrs.get(c.REC_TYPE) == c.PERIODIC


def read(attrs: dict[str, str]) -> Record | None:
    """One record; None if it names no request (nothing to bill it to). Raises Unreadable
    (or anything) when it names one but its Check facts are garbled."""
    rid = request_id(attrs)
    if rid is None:
        return None
    text = attrs.get(c.REC_AUTHZ)
    authz = _json(text)
    if not authz and text not in (None, "", "-", "{}"):
        raise Unreadable(f"ext_authz metadata is not a JSON object: {text[:80]!r}")
    facts = handoff.read(authz, attrs.get(c.REC_PATH, ""), rid)
    if facts.duplicate:
        return None  # its id is a live request's: that one's record bills it
    started = _num(attrs.get(c.REC_START)) or 0.0
    duration_us = _num(attrs.get(c.REC_DURATION_US))
    if duration_us is None:  # a cut stream never sent its last byte: its whole life
        duration_us = (_num(attrs.get(c.REC_TOTAL_MS)) or 0.0) * 1000
    response = response_facts(attrs, reader_of(facts.endpoint) is Reader.MESSAGES)
    if response.usage is None and not response.content_events and response.content_chars and (
            (e := ENDPOINTS.get(facts.endpoint)) is None or not e.generates):
        # a whole answer's size (the Lua filter's, for one whose usage it could not read)
        # bills a completion only where the endpoint generates one
        response = replace(response, content_chars=0)
    return Record(rid, facts, response, started, started + duration_us / 1e6)


def response_facts(attrs: dict[str, str], messages: bool) -> ResponseFacts:
    """The response as Envoy's filters recorded it. `messages`: an Anthropic answer, whose
    input count leaves out the cache (normalised by usage.anthropic, as ext_proc's)."""
    flags = flags_of(attrs)
    counted = _json(attrs.get(c.REC_COUNTED))  # the Lua filter's: present for a stream only
    reported = _json(attrs.get(c.REC_USAGE))
    usage, input_only = _usage(reported, messages)
    served = reported.get(c.SERVED_MODEL)
    events, chars = count(counted.get(c.CONTENT_EVENTS)), count(counted.get(c.CONTENT_CHARS))
    ttft_us, gen_us = _timings(attrs, counted if events else {})
    return ResponseFacts(
        status=status_of(attrs), flags=flags,
        ended=not flags & c.CUT_FLAGS, end_seen=counted.get(c.STREAM_DONE) is True,
        engine_error=counted.get(c.STREAM_FAILED) is True,
        content_events=events, content_chars=chars, usage=usage, input_only=input_only,
        served_model=served if isinstance(served, str) else "",
        ttft_ms=ttft_us / 1000 if ttft_us is not None else 0.0,
        generation_ms=gen_us / 1000 if gen_us is not None and events else None)


def _epoch_us(text: Any) -> int | None:
    """Epoch microseconds from "%s.%6f" (the record's start) or Lua's timestampString
    ("1796611890418420"), as a whole number: a double would round the last microsecond."""
    if not isinstance(text, str) or not text or text == "-":
        return None
    whole, _, frac = text.partition(".")
    if not (whole + frac).isascii() or not whole.isdigit() or (frac and not frac.isdigit()):
        return None
    return int(whole) * 1_000_000 + int((frac + "000000")[:6]) if frac else int(whole)


def _timings(attrs: dict[str, str], counted: dict[str, Any]) -> tuple[float | None,
                                                                      float | None]:
    """(TTFT, generation) in µs from the request's start. TTFT is to the first content
    event when the Lua filter stamped one (`counted` of a stream with content), else to the
    engine's first body byte (a whole JSON answer, or a stream without content); generation
    runs from there to the engine's last byte (a cut stream: to its end).
    The stamp is Envoy's wall clock less the record's start (wall clock too), the other
    marks are Envoy's monotonic durations: the stamp is kept between the first byte and the
    last, so a clock step cannot give a TTFT outside the stream."""
    first_byte, gen = _num(attrs.get(c.REC_TTFT_US)), _num(attrs.get(c.REC_GEN_US))
    if first_byte is None:
        return None, None
    if gen is not None:
        end: float | None = first_byte + gen
    else:  # cut: generating until its end
        total_ms = _num(attrs.get(c.REC_TOTAL_MS))
        end = max(total_ms * 1000, first_byte) if total_ms is not None else None
    ttft = first_byte
    stamp = _epoch_us(counted.get(c.FIRST_CONTENT_US))
    start = _epoch_us(attrs.get(c.REC_START)) if stamp is not None else None
    if stamp is not None and start is not None:
        ttft = max(float(stamp - start), first_byte)
        if end is not None:
            ttft = min(ttft, end)
    return ttft, (end - ttft if end is not None else None)


def _usage(reported: dict[str, Any], messages: bool) -> tuple[Usage | None, bool]:
    """The usage numbers the Lua filter / json_to_metadata recorded, normalised (None: the
    engine reported none), and whether they are only its input side: Anthropic's
    message_start came, its message_delta did not (the Lua filter leaves message_start's
    output count out)."""
    get = reported.get
    if c.PROMPT_TOKENS not in reported and c.COMPLETION_TOKENS not in reported:
        return None, False
    prompt, completion = count(get(c.PROMPT_TOKENS)), count(get(c.COMPLETION_TOKENS))
    if messages:
        return anthropic(prompt, completion, count(get(c.CACHE_READ_INPUT_TOKENS)),
                         count(get(c.CACHE_CREATION_INPUT_TOKENS))), \
            c.COMPLETION_TOKENS not in reported
    return Usage(prompt, completion, count(get(c.TOTAL_TOKENS)) or prompt + completion,
                 count(get(c.CACHED_TOKENS)), count(get(c.REASONING_TOKENS))), False
