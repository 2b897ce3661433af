"""One quota across spokes (DESIGN §10), end to end: two whole spokes (Redis, engine,
sidecar, Envoy each) reporting usage to one Tansu, the hub's allocator and one allowance
follower per spoke, as processes. A team's global daily quota follows its use from one
spoke to the other, and the two together stay within it plus what requests in flight use
past their reservations: nothing here, every reservation covers its request
(docs/hub-and-spokes.md "One quota across spokes", where these numbers go)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
import redis

from devspoke.stack import Spoke
from gateway.hub.quota_topic import QUOTA_TOPIC
from gateway.hub.topics import read_all
from gateway.limits import maths
from testkit import quota as hub

pytestmark = pytest.mark.slow

QUOTA = 3000  # tokens per day, for each team, all spokes together
MAX_TOKENS = 20  # the mock engine answers "hello there" (2 tokens) with 20: 22 a request
CONCURRENCY = 3  # per spoke: requests in flight at once
# The bound's in-flight term (README): what the requests in flight can use past their
# reservations, (actual - reserved)+ each. Here every reservation (prompt estimate plus
# max_tokens) covers the 22 tokens a request uses, so the bound is the quota itself.
PAST = CONCURRENCY * hub.past_reservation(MAX_TOKENS)  # per spoke
BOUND = QUOTA + 2 * PAST
SHORT = 2 * CONCURRENCY * (MAX_TOKENS + 2)  # under-use: up to the requests in flight
INTERVAL_S = 0.5  # the allocator's
DENIED_FOR = 2.5  # a load stops once every answer for this long was a 429


def allowance(spoke: Spoke, team: str) -> int | None:
    raw = redis.Redis.from_url(spoke.redis_url).get(
        f"gw:allow:tpd:team:{team}:{maths.day_id(time.time())}")
    return None if raw is None else int(raw)


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def applied_all_sent(bootstrap: str, spokes: dict[str, Spoke]) -> None:
    """Wait until each spoke has applied the last allowances the (now stopped) allocator
    sent it: one sent just before the stop may still be on its way to the spoke's follower
    (a loaded machine once applied it after the test had read what the spokes held)."""
    sent: dict[str, int] = {}
    for key, value in asyncio.run(read_all(bootstrap, QUOTA_TOPIC)):
        if key in spokes and value is not None:
            sent[key] = int(orjson.loads(value)["generation"])

    def applied() -> bool:
        return all(int(redis.Redis.from_url(s.redis_url).get("gw:allow:gen") or 0)
                   >= sent.get(name, 0) for name, s in spokes.items())

    wait_for(applied, what=f"the spokes applying generations {sent}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[hub.Fleet]:
    with hub.fleet(tmp_path, ["b", "g", "h"], QUOTA) as f:
        yield f


def test_one_daily_quota_follows_use_across_two_spokes(fleet: hub.Fleet) -> None:
    spokes, keys = fleet.spokes, fleet.keys
    east, west = spokes["east"], spokes["west"]
    together = hub.together

    def load(spoke: Spoke, key: str, denied_for: float = DENIED_FOR,
             until_tokens: int | None = None) -> Callable[[], hub.Drive]:
        return lambda: hub.drive(spoke, keys[key], concurrency=CONCURRENCY,
                                 max_tokens=MAX_TOKENS, until_denied_for=denied_for,
                                 until_tokens=until_tokens)

    # No allocator yet: east holds no allowance, so it enforces the fallback share.
    first = load(east, "kg", denied_for=1.5)()
    assert first.codes == {"insufficient_quota"}
    assert 0 < first.served_tokens <= maths.fallback_allowance(QUOTA) + PAST

    alloc = hub.allocator(fleet.kafka.address, fleet.workdir, INTERVAL_S).start()
    fleet.procs.append(alloc)
    wait_for(lambda: all(allowance(s, t) is not None for s in (east, west) for t in "bgh"),
             what="both spokes hold allowances")

    # Team b through both spokes at once: they share it, within the quota plus in flight.
    e, w = together(load(east, "kb"), load(west, "kb"))
    total = e.served_tokens + w.served_tokens
    print(f"\nteam b, both spokes from the start: east {e.served_tokens} + west "
          f"{w.served_tokens} = {total} tokens of a {QUOTA} quota: overshoot "
          f"{total - QUOTA:+d} ({(total - QUOTA) / QUOTA:+.1%}); bound {BOUND}")
    assert QUOTA - SHORT <= total <= BOUND
    assert min(e.served_tokens, w.served_tokens) > 0.2 * QUOTA

    # Driven through east while west idles: west's unused share moves to east.
    alone = load(east, "kg")()
    east_total = first.served_tokens + alone.served_tokens
    print(f"team g through east alone: {east_total} of {QUOTA} tokens "
          f"({east_total / QUOTA:.0%}); west holds {allowance(west, 'g')}")
    assert east_total > 0.8 * QUOTA

    # Both together: within the quota plus what requests in flight use past it.
    e, w = together(load(east, "kg"), load(west, "kg"))
    total = east_total + e.served_tokens + w.served_tokens
    print(f"team g, both spokes: {total} tokens served of a {QUOTA} quota: overshoot "
          f"{total - QUOTA:+d} ({(total - QUOTA) / QUOTA:+.1%}); bound {BOUND}")
    assert total <= BOUND

    # Team h: east uses half of it, long enough for the allocator to give east most of the
    # rest; then the allocator stops, and each spoke keeps enforcing what it holds.
    h_east = load(east, "kh", until_tokens=QUOTA // 2)().served_tokens
    # Its rounds follow east's use (3 intervals alone, each a read of Kafka, longer loaded):
    # waited for, not slept for.
    wait_for(lambda: (allowance(east, "h") or 0) > h_east, what="east given more of team h")
    alloc.stop()
    applied_all_sent(fleet.kafka.address, spokes)
    held = {n: allowance(s, "h") for n, s in spokes.items()}
    assert held["east"] is not None and held["west"] is not None
    assert held["east"] > h_east and held["east"] + held["west"] <= QUOTA
    e, w = together(load(east, "kh"), load(west, "kh"))
    print(f"team h, allocator stopped: east {h_east}+{e.served_tokens} of its "
          f"{held['east']}, west {w.served_tokens} of its {held['west']}")
    assert e.served_tokens > 0 and e.codes == {"insufficient_quota"}
    assert h_east + e.served_tokens <= held["east"] + PAST  # what each holds
    assert w.served_tokens <= held["west"] + PAST
    assert {n: allowance(s, "h") for n, s in spokes.items()} == held  # nobody changed them

    # Restarted, it resumes from the topics and hands out nothing twice.
    before = len(alloc.log())
    alloc.start()
    alloc.wait_log("quota_allocator_resumed", after=before)
    time.sleep(3 * INTERVAL_S)
    e2, w2 = together(load(east, "kh", 2.0), load(west, "kh", 2.0))
    h_total = h_east + e.served_tokens + w.served_tokens + e2.served_tokens + w2.served_tokens
    print(f"team h after the allocator's restart: {h_total} tokens served of {QUOTA} "
          f"(overshoot {h_total - QUOTA:+d})")
    assert h_total <= BOUND
    resumed = next(orjson.loads(line) for line in alloc.log()[before:].splitlines()
                   if "quota_allocator_resumed" in line)
    assert resumed["generation"] > 0 and resumed["spokes"] == ["east", "west"]
