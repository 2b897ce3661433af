"""How a stream the client cancelled is billed: a policy rule, applied to the facts (pure).

The team's rule (or the platform's, `gateway/policy/schema.py` `Billing`) reaches metering
in the Check's metadata (`handoff`), so the rule a request was admitted under is the one
it is billed under, whatever the policy says by the time it ends.

* `generated`: what the engine generated: the prompt and every completion token it reported
  (continuous usage), or, when it reported none, the estimate from what streamed.
* `delivered`: the prompt, and the completion tokens estimated from the content that passed
  to the client (never more than were generated).
* `none`: nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.metering.usage import Usage

CancelRule = Literal["generated", "delivered", "none"]
CANCEL_RULES: tuple[CancelRule, ...] = ("generated", "delivered", "none")
DEFAULT_CANCEL_RULE: CancelRule = "generated"  # the behaviour before rules existed


@dataclass(frozen=True, slots=True)
class Cancellation:
    """The facts of a client-cancelled stream, and the rule it was billed by. All empty for
    every other outcome."""

    billing_rule: str = ""
    prompt_tokens: int = 0  # the prompt the engine processed (billed unless `none`)
    generated_completion_tokens: int = 0
    delivered_completion_tokens: int = 0


NOT_CANCELLED = Cancellation()


def rule_of(value: object) -> CancelRule:
    """A rule read from metadata: an unknown or absent value is the default (a Check from a
    version that wrote none bills as before)."""
    for rule in CANCEL_RULES:
        if value == rule:
            return rule
    return DEFAULT_CANCEL_RULE


def bill(usage: Usage, delivered: int, rule: CancelRule) -> tuple[Usage, Cancellation]:
    """The billed usage of a client-cancelled stream and its facts.

    `usage` is what the engine generated, as metered (reported, or estimated from what
    streamed); `delivered` is the completion estimated from the content that passed to the
    client (max(content events, ceil(chars / 4)))."""
    generated = usage.completion_tokens
    delivered = min(delivered, generated)
    facts = Cancellation(rule, usage.prompt_tokens, generated, delivered)
    if rule == "none":
        return Usage(), facts
    if rule == "delivered" and delivered < generated:
        return Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=delivered,
            total_tokens=usage.prompt_tokens + delivered, cached_tokens=usage.cached_tokens,
            reasoning_tokens=min(usage.reasoning_tokens, delivered),
            cache_creation_tokens=usage.cache_creation_tokens), facts
    return usage, facts
