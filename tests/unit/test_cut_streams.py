"""ext_proc's early-ended streams wait for Envoy's word on who ended them (Recorder.finish_cut
and told): the engine (UPE) → upstream_error, the client (DC) or no word → client_cancelled.
The spool is a fake: what is tested is the recorder's choice, not delivery."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.metering.meter import Meter
from gateway.metering.recorder import Recorder
from gateway.sinks.gate import UsageGate
from gateway.usage_event import UsageEvent


class FakeSpool:
    instance_id = "test"

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.gate = UsageGate()

    def next_seq(self) -> int:
        return len(self.events) + 1

    def put(self, seq: int, data: bytes, on_durable: Any = None) -> None:
        self.events.append(data)


def recorder() -> tuple[Recorder, FakeSpool]:
    spool = FakeSpool()
    clock = SystemClock()
    return Recorder(spool, "s", Ledger(MemoryLimiter(), clock, 30.0)), spool  # type: ignore[arg-type]


def facts(rid: str) -> RequestFacts:
    return RequestFacts(request_id=rid, key_id="k", team="t", model="m",
                        endpoint="/v1/chat/completions", stream=True)


def meter() -> ResponseFacts:
    m = Meter("/v1/chat/completions", True)
    m.response_headers(200, "text/event-stream")
    m.chunk(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', False)
    return m.facts()


async def test_the_word_decides_the_outcome_whichever_comes_first() -> None:
    rec, _ = recorder()
    got: list[UsageEvent] = []
    rec.finish_cut(facts("engine"), meter(), 0.0, got.append, wait_s=5)
    rec.finish_cut(facts("client"), meter(), 0.0, got.append, wait_s=5)
    assert got == []  # waiting for Envoy's record
    rec.told("engine", frozenset({"UPE"}))
    rec.told("client", frozenset({"DC"}))
    rec.told("early", frozenset({"UPE"}))  # the record came before ext_proc saw the end
    rec.finish_cut(facts("early"), meter(), 0.0, got.append, wait_s=5)
    assert [(e.event_id, e.outcome) for e in got] == [
        ("engine", "upstream_error"), ("client", "client_cancelled"), ("early", "upstream_error")]
    assert got[0].usage.completion_tokens == 1  # what streamed, estimated
    rec.told("engine", frozenset({"UPE"}))  # a duplicate record emits nothing more
    assert len(got) == 3


async def test_no_word_is_a_client_cancel_after_the_wait() -> None:
    rec, spool = recorder()
    rec.finish_cut(facts("quiet"), meter(), 0.0, wait_s=0.05)
    await asyncio.sleep(0.1)
    assert len(spool.events) == 1 and b'"client_cancelled"' in spool.events[0]


async def test_a_stream_cut_before_its_first_byte_takes_the_status_from_the_word() -> None:
    """ext_proc learns the status with the first body byte (response headers are skipped):
    a stream the engine cut right after its headers had none here, and billed nothing, where
    Envoy's record says 200 and bills the prompt (the engine had read it)."""
    rec, _ = recorder()
    got: list[UsageEvent] = []
    cut = RequestFacts(request_id="cut", key_id="k", team="t", model="m",
                       endpoint="/v1/chat/completions", stream=True, prompt_estimate=7)
    rec.finish_cut(cut, ResponseFacts(), 0.0, got.append, wait_s=5)
    rec.told("cut", frozenset({"UPE"}), 200)
    [e] = got
    assert (e.outcome, e.status_code, e.usage_source) == ("upstream_error", 200, "estimated")
    assert (e.usage.prompt_tokens, e.usage.completion_tokens) == (7, 0)


def bodiless(rid: str) -> RequestFacts:
    return RequestFacts(request_id=rid, key_id="k", team="t", model="m",
                        endpoint="/v1/chat/completions", stream=False, prompt_estimate=7)


async def test_an_answer_with_no_body_takes_status_and_end_from_the_word() -> None:
    """No response message opened for a bodiless answer (response headers SKIP on the API's
    POST routes): Envoy's record, a status and no flag, says it ended normally, before or
    after the stream's end. A success bills the prompt, no completion; a 4xx nothing; a
    5xx is upstream_error. Before: client_cancelled, status 0."""
    rec, _ = recorder()
    got: list[UsageEvent] = []
    rec.finish_cut(bodiless("204"), ResponseFacts(), 0.0, got.append, wait_s=5)
    rec.told("204", frozenset(), 204)
    rec.told("500", frozenset(), 500)  # the record before the stream's end
    rec.finish_cut(bodiless("500"), ResponseFacts(), 0.0, got.append, wait_s=5)
    rec.finish_cut(bodiless("404"), ResponseFacts(), 0.0, got.append, wait_s=5)
    rec.told("404", frozenset(), 404)
    assert [(e.event_id, e.outcome, e.status_code) for e in got] == [
        ("204", "completed", 204), ("500", "upstream_error", 500), ("404", "completed", 404)]
    assert [(e.usage.prompt_tokens, e.usage.completion_tokens, e.usage_source)
            for e in got] == [(7, 0, "estimated"), (0, 0, "reported"), (0, 0, "reported")]
    rec.told("204", frozenset(), 204)  # a batch sent again: nothing more
    assert len(got) == 3


async def test_a_word_for_a_stream_settled_otherwise_emits_nothing_and_expires(
        monkeypatch: Any) -> None:
    """A word whose stream saw its end (an empty last chunk: finish, not finish_cut) or
    whose wait ran out is never used: no second event, and it is dropped TOLD_KEEP_S later
    instead of held until TOLD_MAX newer words push it out."""
    from gateway.metering import recorder as recorder_module

    rec, spool = recorder()
    rec.finish(bodiless("ended"), ResponseFacts(status=200, ended=True), 0.0)
    rec.finish_cut(bodiless("late"), ResponseFacts(), 0.0, wait_s=0.01)
    await asyncio.sleep(0.05)
    assert len(spool.events) == 2
    rec.told("ended", frozenset(), 200)
    rec.told("late", frozenset(), 204)
    assert len(spool.events) == 2 and len(rec._told) == 2
    now = recorder_module.time.monotonic()
    monkeypatch.setattr(recorder_module.time, "monotonic",
                        lambda: now + recorder_module.TOLD_KEEP_S + 1)
    rec.told("fresh", frozenset({"DC"}))
    assert list(rec._told) == ["fresh"]


async def test_a_flagged_word_or_none_keeps_its_outcome() -> None:
    """Only a flagless word with a status is an end: a DC with a status stays a cancel."""
    rec, _ = recorder()
    got: list[UsageEvent] = []
    rec.finish_cut(bodiless("dc"), ResponseFacts(), 0.0, got.append, wait_s=5)
    rec.told("dc", frozenset({"DC"}), 200)
    rec.finish_cut(bodiless("none"), ResponseFacts(), 0.0, got.append, wait_s=0.01)
    await asyncio.sleep(0.05)
    assert [(e.outcome, e.status_code) for e in got] == [
        ("client_cancelled", 200), ("client_cancelled", 0)]


async def test_a_stream_cut_after_end_waits_is_emitted_at_once() -> None:
    """A stopping sidecar's gRPC stop cancels its streams, and a handler's `finally` may run
    after end_waits: its event must not wait for a word past the spool's last commit."""
    rec, spool = recorder()
    rec.finish_cut(facts("before"), meter(), 0.0, wait_s=5)
    rec.end_waits()
    assert len(spool.events) == 1  # the one waiting
    rec.finish_cut(facts("late"), meter(), 0.0, wait_s=5)
    assert len(spool.events) == 2 and b'"late"' in spool.events[1]
    assert b'"client_cancelled"' in spool.events[1]
