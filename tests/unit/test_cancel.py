"""The cancellation billing rule (gateway/metering/cancel.py): pure, facts in, billed usage out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.metering.cancel import CANCEL_RULES, Cancellation, bill, rule_of
from gateway.metering.usage import Usage

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
