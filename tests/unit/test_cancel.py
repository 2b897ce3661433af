"""The cancellation billing rule (gateway/metering/cancel.py): pure, facts in, billed usage out."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.metering import billing, handoff, record
from gateway.metering.cancel import bill
from gateway.metering.exchange import Exchange
from gateway.metering.recorder import Recorder
from gateway.policy.billing_rules import CANCEL_RULES, rule_of
from gateway.sinks.gate import UsageGate
from gateway.usage_event import Cancellation, Usage

# The engine reported 30 completion tokens (continuous usage); 12 reached the client.
REPORTED = Usage(prompt_tokens=100, completion_tokens=30, total_tokens=130, cached_tokens=64,
                 reasoning_tokens=20)


def test_generated_bills_what_the_engine_reported() -> None:
    billed, facts = bill(REPORTED, delivered=12, rule="generated")
    assert billed == REPORTED
    assert facts == Cancellation("generated", 100, 30, 12)


def test_delivered_bills_the_prompt_and_what_reached_the_client() -> None:
    billed, facts = bill(REPORTED, delivered=12, rule="delivered")
    assert billed == Usage(prompt_tokens=100, completion_tokens=12, total_tokens=112,
                           cached_tokens=64, reasoning_tokens=12)
    assert facts == Cancellation("delivered", 100, 30, 12)


def test_none_bills_nothing_but_keeps_the_facts() -> None:
    billed, facts = bill(REPORTED, delivered=12, rule="none")
    assert billed == Usage()
    assert facts == Cancellation("none", 100, 30, 12)


def test_delivered_is_never_more_than_generated() -> None:
    """The chars/4 estimate of what passed can overshoot an exact count: capped."""
    billed, facts = bill(Usage(10, 5, 15), delivered=7, rule="delivered")
    assert billed == Usage(10, 5, 15)
    assert facts.generated_completion_tokens == facts.delivered_completion_tokens == 5


def test_without_continuous_usage_generated_and_delivered_are_the_estimate() -> None:
    estimated = Usage(prompt_tokens=8, completion_tokens=6, total_tokens=14)
    for rule in ("generated", "delivered"):
        billed, facts = bill(estimated, delivered=6, rule=rule)  # type: ignore[arg-type]
        assert billed == estimated
        assert facts == Cancellation(rule, 8, 6, 6)


n = st.integers(0, 10**6)
usages = st.builds(lambda p, c, cached, reasoning: Usage(p, c, p + c, min(cached, p),
                                                         min(reasoning, c)), n, n, n, n)


@given(usages, n, st.sampled_from(CANCEL_RULES))
def test_billed_is_ordered_none_le_delivered_le_generated(u: Usage, delivered: int,
                                                          rule: str) -> None:
    billed, facts = bill(u, delivered, rule)  # type: ignore[arg-type]
    assert facts.billing_rule == rule
    assert facts.delivered_completion_tokens <= facts.generated_completion_tokens
    assert bill(u, delivered, "none")[0].total_tokens <= \
        bill(u, delivered, "delivered")[0].total_tokens <= \
        bill(u, delivered, "generated")[0].total_tokens
    if rule != "none":
        assert billed.prompt_tokens == u.prompt_tokens
        assert billed.total_tokens == billed.prompt_tokens + billed.completion_tokens
        assert billed.reasoning_tokens <= billed.completion_tokens


@pytest.mark.parametrize(("value", "rule"), [
    ("generated", "generated"), ("delivered", "delivered"), ("none", "none"),
    (None, "generated"), ("", "generated"), ("NONE", "generated"), (0, "generated")])
def test_rule_of_metadata(value: object, rule: str) -> None:
    assert rule_of(value) == rule


# --- both sources end in the recorder: the event and the settlement follow the rule ----------


class FakeSpool:
    instance_id = "i1"

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.seq = 0
        self.gate = UsageGate()

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def put(self, seq: int, line: bytes, on_durable: Callable[[], None] | None = None) -> None:
        self.lines.append(line)
        if on_durable is not None:
            on_durable()


class FakeLedger:
    def __init__(self) -> None:
        self.settlements: dict[str, int | None] = {}

    def released(self, request_id: str) -> None:
        pass

    def settled(self, request_id: str, tokens: int | None) -> None:
        self.settlements[request_id] = tokens


def _recorder() -> tuple[Recorder, FakeSpool, FakeLedger]:
    spool, ledger = FakeSpool(), FakeLedger()
    return Recorder(spool, "s", ledger), spool, ledger  # type: ignore[arg-type]


AUTHZ = {"request_id": "r1", "key_id": "k", "team": "t", "model": "m", "stream": True,
         "leased": True, "endpoint": "/v1/chat/completions", "prompt_estimate": 12}


def _envoy_record(rule: str, flags: str, continuous: bool) -> record.Record:
    """Envoy's record of a stream: the engine's running usage says 10 completion tokens;
    6 content events (24 chars) passed the Lua filter."""
    usage = {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19}
    attrs = {"rid": "r1", "path": "/v1/chat/completions", "code": "200", "flags": flags,
             "start": "1800000000.25", "duration_us": "1000",
             "authz": orjson.dumps(AUTHZ | {"cancelled": rule}).decode(),
             "usage": orjson.dumps(usage).decode() if continuous else "-",
             "counted": '{"content_events":6,"content_chars":24}'}
    rec = record.read(attrs)
    assert rec is not None
    return rec


@pytest.mark.parametrize(("rule", "continuous", "billed", "generated"), [
    ("generated", True, Usage(9, 10, 19), 10),
    ("delivered", True, Usage(9, 6, 15), 10),
    ("none", True, Usage(), 10),
    ("generated", False, Usage(12, 6, 18), 6),  # no running usage: the estimate, both ways
    ("delivered", False, Usage(12, 6, 18), 6),
    ("none", False, Usage(), 6),
])
def test_a_client_cancel_via_envoys_record(rule: str, continuous: bool, billed: Usage,
                                           generated: int) -> None:
    rec = _envoy_record(rule, "DC", continuous)
    rec_, spool, ledger = _recorder()
    event = rec_.emit(rec.facts, billing.settle(rec.facts, rec.response), rec.started,
                      rec.ended)
    assert event.outcome == "client_cancelled" and event.usage == billed
    assert event.cancellation == Cancellation(rule, 9 if continuous else 12, generated, 6)
    assert ledger.settlements == {"r1": billed.total_tokens}  # the counters settle to the bill
    assert orjson.loads(spool.lines[0])["cancellation"]["billing_rule"] == rule


@pytest.mark.parametrize("rule", CANCEL_RULES)
def test_other_outcomes_ignore_the_rule(rule: str) -> None:
    rec = _envoy_record(rule, "-", continuous=True)  # completed
    rec_, _, ledger = _recorder()
    event = rec_.emit(rec.facts, billing.settle(rec.facts, rec.response), rec.started,
                      rec.ended)
    assert event.outcome == "completed" and event.usage == Usage(9, 10, 19)
    assert event.cancellation == Cancellation() and ledger.settlements == {"r1": 19}


CHUNK = (b'data: {"id":"c","object":"chat.completion.chunk","model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"%s"}}],'
         b'"usage":{"prompt_tokens":7,"completion_tokens":%d,"total_tokens":%d}}\n\n')


@pytest.mark.parametrize(("rule", "billed"), [
    ("generated", Usage(7, 8, 15)), ("delivered", Usage(7, 3, 10)), ("none", Usage())])
def test_a_client_cancel_via_ext_proc(rule: str, billed: Usage) -> None:
    """The engine reports 8 tokens generated by its third chunk (it batches), while three
    one-character pieces of content passed: generated 8, delivered 3."""
    ex = Exchange()
    ex.learn(handoff.read(AUTHZ | {"cancelled": rule}))
    ex.response_headers(200, "text/event-stream", False)
    for i, n in enumerate((2, 5, 8)):
        ex.response_body(CHUNK % (b"abc"[i:i + 1], n, 7 + n), False)
    assert ex.outcome() == "client_cancelled"
    rec_, _, ledger = _recorder()
    event = rec_.finish(ex.facts, ex.response(), ex.started)  # type: ignore[arg-type]
    assert event.usage == billed and event.usage_source == "reported"
    assert event.cancellation == Cancellation(rule, 7, 8, 3)
    assert ledger.settlements == {"r1": billed.total_tokens}
