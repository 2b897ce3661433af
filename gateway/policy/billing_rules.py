"""The rules a team may choose for billing a stream its client cancelled (`cancelled:` in the
policy, gateway/policy/schema.py `Billing`); gateway/metering/cancel.py applies them.

The rule reaches metering in the Check's metadata (`handoff`), so the rule a request was
admitted under is the one it is billed under, whatever the policy says by the time it ends.

* `generated`: what the engine generated: the prompt and every completion token it reported
  (continuous usage), or, when it reported none, the estimate from what streamed.
* `delivered`: the prompt, and the completion tokens estimated from the content that passed
  to the client (never more than were generated).
* `none`: nothing.
"""

from __future__ import annotations

from typing import Literal

CancelRule = Literal["generated", "delivered", "none"]
CANCEL_RULES: tuple[CancelRule, ...] = ("generated", "delivered", "none")
DEFAULT_CANCEL_RULE: CancelRule = "generated"  # the behaviour before rules existed


def rule_of(value: object) -> CancelRule:
    """A rule read from metadata: an unknown or absent value is the default (a Check from a
    version that wrote none bills as before)."""
    for rule in CANCEL_RULES:
        if value == rule:
            return rule
    return DEFAULT_CANCEL_RULE
