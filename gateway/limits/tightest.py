"""Pick the tier closest to its limit for the x-ratelimit-* headers (shared by both stores)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Tightest:
    """Keeps the (limit, remaining, reset) triple with the smallest remaining share."""

    limit: int | None = None
    remaining: int | None = None
    reset: float | None = None

    def offer(self, limit: int, remaining: float, reset: float) -> None:
        rem = max(0, int(remaining))
        if self.limit is None or rem * (self.limit or 1) < (self.remaining or 0) * limit:
            self.limit, self.remaining, self.reset = limit, rem, max(0.0, reset)
