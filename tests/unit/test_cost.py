"""Prices in the policy and each event's cost: the price in force when the request started."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
import pytest

from gateway.errors import PolicyError
from gateway.metering.billing import settle
from gateway.metering.cost import cost
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.metering.recorder import Recorder
from gateway.policy.loader import dump_yaml, load, parse_doc
from gateway.policy.prices import PriceBook, Rates
from gateway.sinks.gate import UsageGate
from gateway.usage_event import Usage


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


PRICED = """
models:
  m:
    prices:
      - {effective: 2026-12-01T12:00:00Z, input: 4, output: 8}           # the afternoon's
      - {effective: 2026-01-01T00:00:00Z, input: 2, cached_input: 0.5, cache_creation: 2.5,
         output: 6}
  free: {}
teams: {t: {models: ["*"]}}
"""


def test_cost_charges_each_kind_of_token_at_its_rate() -> None:
    r = Rates(0, input=2, cached_input=0.5, cache_creation=2.5, output=6)
    # 1000 prompt tokens of which 300 read from the cache and 100 written to it; 50 out
    u = Usage(prompt_tokens=1000, completion_tokens=50, total_tokens=1050, cached_tokens=300,
              cache_creation_tokens=100)
    assert cost(u, r) == pytest.approx((600 * 2 + 300 * 0.5 + 100 * 2.5 + 50 * 6) / 1e6)
    assert cost(Usage(), r) == 0


def test_the_price_in_force_is_the_latest_entry_not_after_the_instant() -> None:
    policy = load(PRICED)
    assert policy.price("m", ts("2025-12-31T23:59:59Z")) is None  # before any price
    morning = policy.price("m", ts("2026-12-01T11:59:59.999Z"))
    afternoon = policy.price("m", ts("2026-12-01T12:00:00Z"))
    assert morning is not None and (morning.input, morning.cached_input, morning.output) == \
        (2, 0.5, 6)
    # cached input and cache creation default to the input price
    assert afternoon is not None and (afternoon.input, afternoon.cached_input,
                                      afternoon.cache_creation) == (4, 4, 4)
    assert policy.price("free", ts("2026-12-01T12:00:00Z")) is None
    assert policy.price("nope", ts("2026-12-01T12:00:00Z")) is None
    assert PriceBook([]).at(0) is None


def test_prices_round_trip_through_policy_show() -> None:
    doc = parse_doc(PRICED)
    assert parse_doc(dump_yaml(doc)) == doc
    assert "effective: '2026-01-01T00:00:00Z'" in dump_yaml(doc)


@pytest.mark.parametrize(("price", "path"), [
    ("{effective: 2026-01-01T00:00:00Z, input: -1, output: 1}", "models.m.prices.0.input"),
    ("{effective: 2026-01-01T00:00:00, input: 1, output: 1}", "models.m.prices.0.effective"),
    ("{effective: 2026-01-01T00:00:00Z, input: 1}", "models.m.prices.0.output"),
    ("{effective: 2026-01-01T00:00:00Z, input: 1, output: 1, currency: EUR}",
     "models.m.prices.0.currency"),
])
def test_a_bad_price_names_its_path(price: str, path: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(f"models: {{m: {{prices: [{price}]}}}}")
    assert info.value.problems[0].startswith(f"{path}:"), info.value.problems


@pytest.mark.parametrize(("price", "path"), [
    ("{effective: 2026-01-01T00:00:00Z, input: .inf, output: 1}", "models.m.prices.0.input"),
    ("{effective: 2026-01-01T00:00:00Z, input: 1, output: .nan}", "models.m.prices.0.output"),
    ("{effective: 2026-01-01T00:00:00Z, input: 1, cached_input: .inf, output: 1}",
     "models.m.prices.0.cached_input"),
    ("{effective: 2026-01-01T00:00:00Z, input: 1, cache_creation: -.inf, output: 1}",
     "models.m.prices.0.cache_creation"),
])
def test_a_price_that_is_no_finite_number_is_refused_as_such(price: str, path: str) -> None:
    """An infinite price was taken (`ge=0` only), and priced every request of the model at
    an infinite or NaN cost, which JSON cannot carry and billing quarantines; NaN was refused
    as not "greater than or equal to 0", which is not what is wrong with it."""
    with pytest.raises(PolicyError) as info:
        parse_doc(f"models: {{m: {{prices: [{price}]}}}}")
    assert info.value.problems[0].startswith(f"{path}: Input should be a finite number"), (
        info.value.problems)


def test_two_prices_for_one_instant_are_refused() -> None:
    same = "{effective: 2026-01-01T00:00:00Z, input: 1, output: 1}"
    with pytest.raises(PolicyError, match=r"models.m: .*same `effective`"):
        parse_doc(f"models: {{m: {{prices: [{same}, {same}]}}}}")


class Spool:
    instance_id = "i"

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.gate = UsageGate()

    def next_seq(self) -> int:
        return len(self.lines) + 1

    def put(self, seq: int, line: bytes, on_durable: Any = None) -> None:
        self.lines.append(line)


def emit(outcome: str, started: str, stream: bool = True) -> dict[str, Any]:
    policy = load(PRICED)
    spool = Spool()
    rec = Recorder(spool, "s", None, price=policy.price)  # type: ignore[arg-type]
    facts = RequestFacts(request_id="r", key_id="k", team="t", model="m",
                         endpoint="/v1/chat/completions", stream=stream,
                         denied_status=429 if outcome == "denied" else 0)
    response = ResponseFacts(status=200, ended=True, usage=Usage(1000, 100, 1100),
                             served_model="m")
    rec.emit(facts, settle(facts, response), ts(started), ts(started) + 1)
    return dict(orjson.loads(spool.lines[0]))


def test_the_event_costs_the_price_in_force_when_it_started() -> None:
    morning = emit("completed", "2026-12-01T11:59:59.500Z")  # ends after the change
    afternoon = emit("completed", "2026-12-01T12:00:00Z")
    assert morning["cost"] == pytest.approx((1000 * 2 + 100 * 6) / 1e6)
    assert morning["price_effective"] == "2026-01-01T00:00:00.000Z"
    assert afternoon["cost"] == pytest.approx((1000 * 4 + 100 * 8) / 1e6)
    assert afternoon["price_effective"] == "2026-12-01T12:00:00.000Z"


def test_a_denial_costs_nothing_has_no_usage_source_and_keeps_its_stream() -> None:
    event = emit("denied", "2026-12-01T12:00:00Z", stream=True)
    assert (event["outcome"], event["cost"], event["price_effective"]) == ("denied", 0.0, "")
    assert event["usage_source"] == "" and event["stream"] is True


def test_no_price_no_cost() -> None:
    event = emit("completed", "2025-06-01T00:00:00Z")
    assert (event["cost"], event["price_effective"]) == (0.0, "")
