"""Envoy's per-request record → the facts of the usage event (gateway/metering/record.py)."""

from __future__ import annotations

import orjson
import pytest

from gateway import envoy_contract as contract
from gateway.metering import billing, record
from gateway.metering.billing import Billed

AUTHZ = {"request_id": "r1", "key_id": "k", "team": "t", "model": "m", "stream": True,
         "leased": True, "endpoint": "/v1/chat/completions", "prompt_estimate": 12}


def attrs(**over: object) -> dict[str, str]:
    base: dict[str, object] = {
        "rid": "r1", "path": "/v1/chat/completions?x=1", "code": "200", "flags": "-",
        "details": "via_upstream", "start": "1800000000.250000", "duration_us": "1500000",
        "ttft_us": "50000", "gen_us": "900000", "authz": AUTHZ,
        "usage": {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19,
                  "cached_tokens": 4, "model": "served-m"},
        "counted": {"content_events": 10, "content_chars": 40}}
    base.update(over)
    return {k: v if isinstance(v, str) else orjson.dumps(v).decode() for k, v in base.items()}


def read(attrs: dict[str, str]) -> tuple[record.Record, Billed]:
    """The record, and what it bills."""
    rec = record.read(attrs)
    assert rec is not None
    return rec, billing.settle(rec.facts, rec.response)


def checkpoint(attrs: dict[str, str]) -> tuple[int, int] | None:
    rec = record.read(attrs)
    assert rec is not None
    return billing.checkpoint(rec.facts, rec.response)


def test_a_completed_stream_is_billed_what_the_engine_reported() -> None:
    rec, b = read(attrs())
    assert (b.outcome, b.status, b.source) == ("completed", 200, "reported")
    u = b.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens) == (9, 10, 19, 4)
    assert b.served_model == "served-m"
    assert b.ttft_ms == 50.0 and b.tpot_ms == 100.0  # 900 ms / 9 gaps
    assert rec.started == 1800000000.25 and rec.ended == pytest.approx(1800000001.75)
    f = rec.facts
    assert (f.request_id, f.key_id, f.team, f.model, f.leased) == ("r1", "k", "t", "m", True)


@pytest.mark.parametrize(("flags", "code", "outcome"), [
    ("UPE", "200", "upstream_error"),  # the engine cut its stream after the headers
    ("UR", "200", "upstream_error"),
    ("UF", "503", "upstream_error"),
    ("-", "502", "upstream_error"),
    ("DC", "200", "client_cancelled"),  # the client left
    ("DC", "0", "client_cancelled"),
])
def test_how_it_ended(flags: str, code: str, outcome: str) -> None:
    _, b = read(attrs(flags=flags, code=code))
    assert b.outcome == outcome


def test_a_client_that_left_after_the_end_marker_completed() -> None:
    _, b = read(attrs(flags="DC", counted={"content_events": 3, "done": True}))
    assert b.outcome == "completed"


def test_a_cut_stream_without_usage_is_estimated_from_what_passed() -> None:
    _, b = read(attrs(flags="DC", usage="-", counted={"content_events": 7, "content_chars": 60}))
    assert b.source == "estimated"
    u = b.usage
    assert (u.prompt_tokens, u.completion_tokens) == (12, 15)  # ceil(60 / 4) > 7 events


def test_a_cut_anthropic_stream_keeps_message_starts_input_and_cache_counts() -> None:
    """Only message_start came (the engine cut the stream): its input side is exact, the
    cache read and creation counts included; the output is what streamed."""
    messages = dict(AUTHZ, endpoint="/v1/messages")
    _, b = read(attrs(flags="UPE", authz=messages, path="/v1/messages",
                      usage={"prompt_tokens": 7, "cache_read_input_tokens": 43,
                             "cache_creation_input_tokens": 41, "model": "served-m"},
                      counted={"content_events": 5, "content_chars": 12}))
    assert (b.outcome, b.source) == ("upstream_error", "estimated")
    u = b.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (91, 5, 96)
    assert (u.cached_tokens, u.cache_creation_tokens) == (43, 41)


def test_an_error_answer_generated_nothing() -> None:
    _, b = read(attrs(code="400", usage="-", counted="-"))
    assert b.outcome == "completed" and b.source == "reported" and b.usage.total_tokens == 0


def test_denials_and_envoys_own_answers_are_denied_and_free() -> None:
    denied = dict(AUTHZ, denied="model_not_allowed", status=403, leased=False)
    rec, b = read(attrs(code="403", authz=denied, usage="-", counted="-"))
    assert (b.outcome, b.status) == ("denied", 403)
    assert b.usage.total_tokens == 0 and rec.facts.key_id == "k"
    rec, b = read(attrs(code="413", authz="-", usage="-", counted="-"))  # Envoy's own 413
    assert (b.outcome, b.status) == ("denied", 413)
    assert rec.facts.endpoint == "/v1/chat/completions" and rec.facts.key_id == ""


@pytest.mark.parametrize("bad", ["-", "", "not json", "[1,2]", '{"prompt_tokens": "x"}'])
def test_garbage_in_any_field_is_not_a_crash(bad: str) -> None:
    for field in ("usage", "counted", "code", "start", "ttft_us", "gen_us", "total_ms"):
        assert read(attrs(**{field: bad}))[1].usage.total_tokens >= 0
    assert record.read(attrs(rid="-")) is None  # nothing to bill it to


@pytest.mark.parametrize("bad", ["not json", "[1,2]", '"text"', '{"key_id": "k"'])
def test_garbled_check_facts_are_unreadable_not_a_denial(bad: str) -> None:
    """Read as no facts, the request would be billed as denied (nothing) and its admission
    voided: it is unreadable instead, and the orphan sweep bills it from its admission."""
    with pytest.raises(record.Unreadable):
        record.read(attrs(authz=bad))
    assert record.read(attrs(authz="-")) is not None  # Envoy's own answer: no Check at all


def test_a_cut_stream_keeps_its_duration() -> None:
    """A stream cut mid-way never sent its last byte: DS_TX_END is absent, %DURATION% not."""
    rec, _ = read(attrs(flags="DC", duration_us="-", total_ms="2345"))
    assert rec.ended - rec.started == pytest.approx(2.345)


def test_a_heartbeat_is_told_apart_and_checkpoints_the_usage_so_far() -> None:
    beat = attrs(type=contract.PERIODIC, usage="-", duration_us="-", gen_us="-",
                 counted={"content_events": 30, "content_chars": 100})
    assert record.is_heartbeat(beat) and not record.is_heartbeat(attrs(type="DownstreamEnd"))
    assert checkpoint(beat) == (12, 30)  # the prompt estimate; 30 content events
    reported = attrs(type=contract.PERIODIC, usage={"prompt_tokens": 9, "completion_tokens": 4})
    assert checkpoint(reported) == (9, 4)  # continuous usage: exact so far


def test_a_duplicate_id_refusal_has_no_event_of_its_own() -> None:
    dup = dict(AUTHZ, denied="duplicate_request_id", status=409, leased=False)
    assert record.read(attrs(code="409", authz=dup)) is None


def stamped(at_us: int, **over: object) -> dict[str, str]:
    """A record whose Lua filter stamped the first content event `at_us` after the start
    (1800000000.250000)."""
    counted = {"content_events": 10, "content_chars": 40,
               contract.FIRST_CONTENT_US: str(1_800_000_000_250_000 + at_us)}
    return attrs(counted=counted, **over)


def test_ttft_is_to_the_first_content_event_when_the_lua_filter_stamped_it() -> None:
    """A Responses / Anthropic stream's first byte (response.created, message_start) is no
    token: TTFT runs to the stamp, TPOT from there to the engine's last byte."""
    rec, b = read(stamped(404_123))  # first byte at 50 ms, last at 950 ms
    assert rec.response.ttft_ms == 404.123 and rec.response.generation_ms == 950 - 404.123
    assert b.ttft_ms == 404.123 and b.tpot_ms == pytest.approx((950 - 404.123) / 9)
    # cut: no last byte, generating until its end (%DURATION%)
    rec, _ = read(stamped(404_000, flags="DC", duration_us="-", gen_us="-", total_ms="2000"))
    assert (rec.response.ttft_ms, rec.response.generation_ms) == (404.0, 1596.0)


@pytest.mark.parametrize(("at_us", "ttft_ms"), [(-5_000_000, 50.0), (10**9, 950.0)])
def test_a_stamp_outside_the_stream_is_kept_inside_it(at_us: int, ttft_ms: float) -> None:
    """The stamp is wall-clock time, the other marks monotonic: a clock step cannot give a
    TTFT before the first byte or after the last."""
    rec, _ = read(stamped(at_us))
    assert rec.response.ttft_ms == ttft_ms and rec.response.generation_ms == 950 - ttft_ms


@pytest.mark.parametrize("bad", ["", "-", "x", "1.5e15", "١٢٣", "12.3.4"])
def test_an_unreadable_stamp_falls_back_to_the_first_byte(bad: str) -> None:
    counted = {"content_events": 10, "content_chars": 40, contract.FIRST_CONTENT_US: bad}
    rec, _ = read(attrs(counted=counted))
    assert (rec.response.ttft_ms, rec.response.generation_ms) == (50.0, 900.0)
    rec, _ = read(stamped(300_000, start=bad))
    assert (rec.response.ttft_ms, rec.response.generation_ms) == (50.0, 900.0)
