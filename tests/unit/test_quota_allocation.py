"""The allocator's maths (gateway/hub/allocation.py): its promises as properties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.hub.allocation import SpokeUse, allocate

uses = st.builds(SpokeUse, used=st.integers(0, 10_000), held=st.integers(0, 10_000),
                 demand=st.integers(0, 5_000), cap=st.none() | st.integers(0, 10_000))
fleets = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), uses, min_size=1)


@given(st.integers(0, 20_000), fleets)
def test_never_below_use_nor_above_the_quota(quota: int, fleet: dict[str, SpokeUse]) -> None:
    out = allocate(quota, fleet)
    assert out.keys() == fleet.keys()
    for s, u in fleet.items():
        assert out[s] >= u.used
    if sum(u.used for u in fleet.values()) <= quota:
        assert sum(out.values()) <= quota
    else:  # already over: nobody may admit more
        assert out == {s: u.used for s, u in fleet.items()}


@given(st.integers(0, 20_000), fleets)
def test_what_is_held_elsewhere_is_never_handed_out(quota: int,
                                                    fleet: dict[str, SpokeUse]) -> None:
    """Until a lowered spoke reports its new allowance it may admit under its old one."""
    held = {s: max(u.held, u.used) for s, u in fleet.items()}
    out = allocate(quota, fleet)
    if sum(held.values()) <= quota:
        assert sum(max(out[s], held[s]) for s in fleet) <= quota


@given(st.integers(1_000, 100_000), st.integers(1, 5_000))
def test_the_unused_share_moves_to_the_spoke_that_uses_it(quota: int, demand: int) -> None:
    fleet = {"busy": SpokeUse(0, 0, demand), "idle": SpokeUse(0, 0, 0)}
    out = allocate(quota, fleet)
    assert out["busy"] > 0.9 * quota  # the idle spoke keeps a small start (IDLE_WEIGHT)
    assert 0 < out["idle"] < 0.1 * quota or quota < 30


def test_no_demand_anywhere_splits_equally() -> None:
    assert allocate(1000, {"a": SpokeUse(0, 0, 0), "b": SpokeUse(0, 0, 0)}) == {
        "a": 500, "b": 500}


def test_a_lowered_spoke_frees_its_share_only_once_it_reports() -> None:
    # a had 800 of 1000 and idles; b needs more.
    first = allocate(1000, {"a": SpokeUse(100, 800, 0), "b": SpokeUse(200, 200, 100)})
    assert first["a"] < 800 and first["b"] == 200  # b waits: a may still admit up to 800
    # a reports it applied its lower allowance: now b gets what a gave up.
    second = allocate(1000, {"a": SpokeUse(100, first["a"], 0), "b": SpokeUse(200, 200, 100)})
    assert second["b"] > 800 and second["a"] + second["b"] <= 1000


def test_while_more_is_held_than_the_quota_nobody_is_raised() -> None:
    """a overshot its 600 (requests in flight settled above their reservations): 700 + the
    400 b holds exceed the quota, so nobody gets more until b reports a lower allowance."""
    out = allocate(1000, {"a": SpokeUse(700, 600, 0), "b": SpokeUse(100, 400, 50)})
    assert out["a"] == 700 and 100 <= out["b"] < 400

