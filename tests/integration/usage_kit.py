"""The usage topic on a real Tansu for `usage consume`'s tests (test_usage_exactly_once.py,
test_usage_crashes.py): events, a topic of several partitions filled with them, a run of
the consumer until caught up, and the report's totals against the distinct events."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from devspoke.procs import Service
from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.billing import report
from gateway.billing.consumer import consume
from gateway.billing.db import UsageDb
from gateway.sinks.usage_proto import proto_json

PARTITIONS = 3
# The group session (`--session-timeout-s`): Tansu holds a JoinGroup for half of it, and a
# member killed -9 holds its partitions for all of it; the default 6 s made each join here
# 3 to 12 s. A batch of 1000 holds the loop (and the heartbeats, every session/6) ~0.15 s
# idle, more loaded: 2 s leaves them slack (1 s: these tests in 30 s idle against 45, as
# slow loaded).
SESSION_S = 2.0


def event(i: int, ended: str = "2026-12-01T10:00:00.000Z") -> usage_pb2.UsageEvent:
    return usage_pb2.UsageEvent(
        event_id=f"e{i}", instance_id="i1", seq=i, ended_at=ended, team=f"t{i % 3}",
        key_id=f"k{i % 5}", model=f"m{i % 2}", outcome="completed", usage_source="reported",
        endpoint="/v1/chat/completions", cost=round(i * 1e-6, 9),
        usage=usage_pb2.Usage(prompt_tokens=i, completion_tokens=2, total_tokens=i + 2))


async def _topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()


async def _put(bootstrap: str, topic: str, events: list[usage_pb2.UsageEvent]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await p.start()
    try:
        for e in events:  # keyed by event_id, as the gateway produces: spread over partitions
            await p.send(topic, key=e.event_id.encode(), value=proto_json(e))
        await p.flush()
    finally:
        await p.stop()


def put(tansu: Service, topic: str, events: list[usage_pb2.UsageEvent],
        create: bool = False) -> None:
    if create:
        asyncio.run(_topic(tansu.address, topic))
    asyncio.run(_put(tansu.address, topic, events))


def expected(events: list[usage_pb2.UsageEvent]) -> dict[str, tuple[int, int, int]]:
    """team -> (requests, total tokens, cost in nanos), each event_id once."""
    out: dict[str, tuple[int, int, int]] = {}
    for e in {e.event_id: e for e in events}.values():
        n, t, c = out.get(e.team, (0, 0, 0))
        out[e.team] = (n + 1, t + e.usage.total_tokens, c + round(e.cost * 1e9))
    return out


def got(url: str, since: str = "", until: str = "") -> dict[str, tuple[int, int, int]]:
    db = UsageDb(url)
    try:
        return {r.name: (r.completed, r.total_tokens, round(r.cost * 1e9))
                for r in report.report(db, "team", since, until).rows}
    finally:
        db.close()


def run(tansu: Service, topic: str, url: str, group: str) -> int:
    """`group` on this topic only: a group is the broker's, and another test's (a member
    killed -9 still in it until its session expires) must not hold this one's join."""
    return asyncio.run(consume(tansu.address, topic, url, f"{group}.{topic}",
                               until_caught_up=True, session_timeout_s=SESSION_S))
