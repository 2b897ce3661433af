"""Token weights: what a model's tokens count toward its token limits (`token_weights:` in
the policy, docs/policy.md "Weighted tokens"). Opt-in per model; a model without them (or
with all four 1) counts prompt + completion, as before, and none of this runs for it.

A leaf above the usage event: the policy compiles the weights, the Check weighs its
reservation, metering weighs the settlement and the checkpoints the orphan sweep bills.
The usage event's counts stay raw (billing prices them with `prices`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.usage_event import Usage

# A weighted count is rounded to this many decimals before it is rounded up: 0.1 * 1000 is
# 100.00000000000001 in binary floating point, and must count 100, not 101.
_FUZZ = 6


def _up(x: float) -> int:
    return math.ceil(round(x, _FUZZ))


@dataclass(frozen=True, slots=True)
class TokenWeights:
    """One model's weights (finite, 0 to 1000): an uncached prompt token, one read from the
    prompt cache, one written to it, and a completion token (reasoning included)."""

    input: float = 1.0
    cached_input: float = 1.0
    cache_creation: float = 1.0
    output: float = 1.0

    @property
    def default(self) -> bool:
        return self.input == self.cached_input == self.cache_creation == self.output == 1

    def text(self) -> str:
        """The weights as the Check hands them to metering: "input:cached:creation:output"."""
        return ":".join(f"{w:g}" if w == int(w) else repr(w) for w in (
            self.input, self.cached_input, self.cache_creation, self.output))

    @classmethod
    def parse(cls, text: str) -> TokenWeights | None:
        """`text()` read back; None for anything else (the default count applies)."""
        parts = text.split(":")
        if len(parts) != 4:
            return None
        try:
            ws = [float(p) for p in parts]
        except ValueError:
            return None
        if not all(math.isfinite(w) and 0 <= w <= 1000 for w in ws):
            return None
        return cls(*ws)

    def reserve(self, prompt_estimate: int, completion_bound: int) -> int:
        """What the Check reserves: the cache is unknown at admission, so the prompt
        estimate counts at the largest input weight (never under-reserved)."""
        return _up(max(self.input, self.cached_input, self.cache_creation) * prompt_estimate
                   + self.output * completion_bound)

    def describe(self) -> str:
        return (f"input {self.input:g}, cached_input {self.cached_input:g}, cache_creation "
                f"{self.cache_creation:g}, output {self.output:g}")


def limit_tokens(u: Usage, w: TokenWeights | None) -> int:
    """The tokens a request's usage counts toward its token limits ("limit tokens"):
    its total (prompt + completion) without weights; with them,
    ceil(input x uncached + cached_input x cached + cache_creation x created
    + output x completion), where uncached = prompt - cached - created (at least 0:
    `prompt_tokens` counts every input token, the cached and created ones included)."""
    if w is None:
        return u.total_tokens
    uncached = max(0, u.prompt_tokens - u.cached_tokens - u.cache_creation_tokens)
    return _up(w.input * uncached + w.cached_input * u.cached_tokens
               + w.cache_creation * u.cache_creation_tokens + w.output * u.completion_tokens)
