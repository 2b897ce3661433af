"""How a stream the client cancelled is billed: the team's rule
(gateway/policy/billing_rules.py), applied to the facts (pure)."""

from __future__ import annotations

from gateway.policy.billing_rules import CancelRule
from gateway.usage_event import Cancellation, Usage


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
