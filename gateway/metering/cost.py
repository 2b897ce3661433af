"""What a request costs: its billed usage at the model's price in force when it started.

Prices are per million tokens, in the price table's currency. The event carries its cost,
computed when it is made, so a later revision of the price table never reprices the past,
and the billing side needs no copy of the price history to invoice.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gateway.metering.usage import Usage

PER = 1_000_000


@dataclass(frozen=True, slots=True)
class Rates:
    """One model's prices from `effective` (Unix seconds) until the next entry's."""

    effective: float
    input: float  # a prompt token neither read from nor written to the prompt cache
    cached_input: float  # a prompt token read from the cache
    cache_creation: float  # a prompt token written to the cache
    output: float  # a completion token (reasoning tokens included)


class PriceBook:
    """A model's price history, oldest first; `at(t)` is the entry in force at t."""

    __slots__ = ("_starts", "entries")

    def __init__(self, entries: list[Rates]) -> None:
        self.entries = tuple(sorted(entries, key=lambda r: r.effective))
        self._starts = [r.effective for r in self.entries]

    def at(self, ts: float) -> Rates | None:
        i = bisect.bisect_right(self._starts, ts)
        return self.entries[i - 1] if i else None


def cost(u: Usage, r: Rates) -> float:
    """The usage at these rates. Cached and cache-creation tokens are parts of the prompt,
    so only the rest of it is charged as plain input. Rounded to 1e-9 (sums stay exact to
    well below a cent over billions of events)."""
    fresh = max(0, u.prompt_tokens - u.cached_tokens - u.cache_creation_tokens)
    total = (fresh * r.input + u.cached_tokens * r.cached_input
             + u.cache_creation_tokens * r.cache_creation + u.completion_tokens * r.output)
    return round(total / PER, 9)
