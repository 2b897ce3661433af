"""The usage producer on a real Tansu: one batch per partition, each record on the
partition aiokafka's default partitioner gives its key, headers and values intact, and a
batch that fills up continued in another."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner

from devspoke.procs import Service, free_port, tansu_service
from gateway.sinks.producers import KafkaProducer, Record


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path_factory.mktemp("tansu")).start()
    yield svc
    svc.stop()


async def _topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


async def _read(bootstrap: str, topic: str, n: int) -> list[tuple[int, Record]]:
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await c.start()
    got: list[tuple[int, Record]] = []
    try:
        async with asyncio.timeout(30):
            while len(got) < n:
                for tp, msgs in (await c.getmany(timeout_ms=500)).items():
                    got += [(tp.partition, (m.key, m.value, list(m.headers))) for m in msgs]
    finally:
        await c.stop()
    return got


def _records(n: int, size: int = 50) -> list[Record]:
    return [(f"event-{i}".encode(), f"{i:06d}".encode() * (size // 6 + 1),
             [("ce_id", f"event-{i}".encode()), ("content-type", b"application/json")])
            for i in range(n)]


@pytest.mark.parametrize("partitions", [1, 3])
async def test_each_record_on_its_keys_partition_in_order(tansu: Service,
                                                           partitions: int) -> None:
    topic = f"usage.p{partitions}"
    await _topic(tansu.address, topic, partitions)
    records = _records(300)
    producer = KafkaProducer(tansu.address, topic, idempotence=False)
    try:
        await producer.send_batch(records[:200])
        await producer.send_batch(records[200:])
    finally:
        await producer.close()
    got = await _read(tansu.address, topic, len(records))
    assert sorted(r for _, r in got) == sorted(records)  # each once, headers intact
    assert len({p for p, _ in got}) == partitions
    part = DefaultPartitioner()
    for p, (key, _, _) in got:
        assert p == part(key, list(range(partitions)), list(range(partitions)))
    for p in range(partitions):  # a partition keeps the order they were sent in
        mine = [r for q, r in got if q == p]
        assert mine == [r for r in records if r in mine]


async def test_a_batch_that_fills_up_goes_on_in_another(tansu: Service) -> None:
    topic = "usage.big"
    await _topic(tansu.address, topic, 1)
    records = _records(12, size=200_000)  # 2.4 MB: three batches of at most 1 MiB
    producer = KafkaProducer(tansu.address, topic, idempotence=False)
    try:
        await producer.send_batch(records)
    finally:
        await producer.close()
    assert [r for _, r in await _read(tansu.address, topic, len(records))] == records


async def test_the_same_partitions_as_aiokafkas_own_send(tansu: Service) -> None:
    """What `send()` per record chose before, for the same keys."""
    topic = "usage.same"
    await _topic(tansu.address, topic, 4)
    records = _records(100)
    p = AIOKafkaProducer(bootstrap_servers=tansu.address, acks="all")
    await p.start()
    try:
        sent = [await (await p.send(topic, key=k, value=v, headers=h)) for k, v, h in records]
    finally:
        await p.stop()
    before = {k: md.partition for (k, _, _), md in zip(records, sent, strict=True)}
    producer = KafkaProducer(tansu.address, topic, idempotence=False)
    try:
        await producer.send_batch(records)
    finally:
        await producer.close()
    got = await _read(tansu.address, topic, 2 * len(records))
    assert len({p for p, _ in got}) == 4
    assert all(p == before[k] for p, (k, _, _) in got)
