"""A model's price history, read from the policy (`prices:` in gateway/policy/schema.py);
gateway/metering/cost.py prices a request's usage with the entry in force when it started.

Prices are per million tokens, in the price table's currency.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gateway.policy.schema import Price


@dataclass(frozen=True, slots=True)
class Rates:
    """One model's prices from `effective` (Unix seconds) until the next entry's."""

    effective: float
    input: float  # a prompt token neither read from nor written to the prompt cache
    cached_input: float  # a prompt token read from the cache
    cache_creation: float  # a prompt token written to the cache
    output: float  # a completion token (reasoning tokens included)

    @classmethod
    def of(cls, p: Price) -> Rates:
        """A policy entry's rates: cached input and cache creation default to `input`."""
        return cls(p.effective.timestamp(), p.input,
                   p.input if p.cached_input is None else p.cached_input,
                   p.input if p.cache_creation is None else p.cache_creation, p.output)


class PriceBook:
    """A model's price history, oldest first; `at(t)` is the entry in force at t."""

    __slots__ = ("_starts", "entries")

    def __init__(self, entries: list[Rates]) -> None:
        self.entries = tuple(sorted(entries, key=lambda r: r.effective))
        self._starts = [r.effective for r in self.entries]

    def at(self, ts: float) -> Rates | None:
        i = bisect.bisect_right(self._starts, ts)
        return self.entries[i - 1] if i else None
