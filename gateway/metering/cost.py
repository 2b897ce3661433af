"""What a request costs: its billed usage at the model's price in force when it started
(gateway/policy/prices.py).

The event carries its cost, computed when it is made, so a later revision of the price table
never reprices the past, and the billing side needs no copy of the price history to invoice.
"""

from __future__ import annotations

from gateway.policy.prices import Rates
from gateway.usage_event import Usage

PER = 1_000_000  # prices are per million tokens


def cost(u: Usage, r: Rates) -> float:
    """The usage at these rates. Cached and cache-creation tokens are parts of the prompt,
    so only the rest of it is charged as plain input. Rounded to 1e-9 (sums stay exact to
    well below a cent over billions of events)."""
    fresh = max(0, u.prompt_tokens - u.cached_tokens - u.cache_creation_tokens)
    total = (fresh * r.input + u.cached_tokens * r.cached_input
             + u.cache_creation_tokens * r.cache_creation + u.completion_tokens * r.output)
    return round(total / PER, 9)
