"""The allocator's maths: one global quota divided into per-spoke allowances (DESIGN §10).

Pure: no I/O, no clock. An allowance is a spoke's TOTAL for the period. Each spoke may be
admitting under more than its newest allowance until it reports having applied it (an
older, larger one may still be in force there): `held` is that most, and the allocator
never hands out what is held elsewhere. So the spokes together admit at most the quota;
what they can consume beyond it is only what requests in flight use past their
reservations (docs/hub-and-spokes.md "One quota across spokes").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# An idle spoke's weight, as a share of the busy spokes' mean demand: enough headroom for
# it to start serving, most of the unused quota to the spokes that use it.
IDLE_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class SpokeUse:
    used: int  # tokens it has used this period, as far as the allocator knows
    held: int  # the most it may be admitting under now (allowances not yet reported applied)
    demand: int  # tokens it used over the last minute or so: how fast it spends
    cap: int | None = None  # the most worth giving it (a spoke with no follower: its use)


def allocate(quota: int, spokes: Mapping[str, SpokeUse],
             idle_weight: float = IDLE_WEIGHT) -> dict[str, int]:
    """Each spoke's new allowance.

    * never below what a spoke used;
    * in total never more than the quota (unless the use alone already is: then each
      spoke gets exactly its use, so nobody admits more);
    * what is held elsewhere is never handed out: with H_i = max(held_i, used_i), if
      sum(H) <= quota then sum(max(new_i, H_i)) <= quota. A spoke lowered keeps counting
      its old allowance until it reports the new one, and what it gives up goes to the
      others in the next allocation;
    * the free quota (quota - sum(used)) goes to the spokes in proportion to their
      demand, an idle one weighing `idle_weight` of the mean; with no demand anywhere,
      equally.
    """
    if not spokes:
        return {}
    used = {s: max(u.used, 0) for s, u in spokes.items()}
    free = quota - sum(used.values())
    if free <= 0:
        return used
    total_demand = sum(max(u.demand, 0) for u in spokes.values())
    n = len(spokes)
    if total_demand == 0:
        weights = {s: 1.0 for s in spokes}
    else:
        floor = idle_weight * total_demand / n
        weights = {s: max(u.demand, 0) + floor for s, u in spokes.items()}
    # Water-filling: a capped spoke takes no more than its cap; the rest is shared again.
    target: dict[str, int] = {}
    active = set(spokes)
    while True:
        left = free - sum(target[s] - used[s] for s in target)
        wsum = sum(weights[s] for s in active)
        over = {s for s in active if spokes[s].cap is not None
                and used[s] + left * weights[s] / wsum > max(used[s], spokes[s].cap or 0)}
        if not over:
            break
        for s in over:
            target[s] = max(used[s], spokes[s].cap or 0)
        active -= over
    for s in active:
        target[s] = used[s] + int(left * weights[s] / wsum)
    held = {s: max(u.held, used[s]) for s, u in spokes.items()}
    out: dict[str, int] = {}
    raise_wanted: dict[str, int] = {}
    for s in spokes:
        if target[s] < held[s]:
            out[s] = target[s]  # lowered: it counts `held` until it reports this one
        else:
            raise_wanted[s] = target[s] - held[s]
    room = max(0, quota - sum(held.values()))
    want = sum(raise_wanted.values())
    for s, w in raise_wanted.items():
        grant = w if want <= room else int(w * room / want)
        out[s] = held[s] + grant
    return out
