"""Pick the binding tier for the x-ratelimit-* headers: the one with the fewest remaining,
since OpenAI's "remaining" means what will still be admitted (mirrored in admit.lua)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Tightest:
    """Keeps the (limit, remaining, reset) triple with the smallest remaining count."""

    limit: int | None = None
    remaining: int | None = None
    reset: float | None = None

    def offer(self, limit: int, remaining: float, reset: float) -> None:
        rem = max(0, int(remaining))
        if self.limit is None or rem < (self.remaining or 0) or (
                rem == self.remaining and limit < self.limit):
            self.limit, self.remaining, self.reset = limit, rem, max(0.0, reset)
