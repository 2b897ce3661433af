"""Sinks the shipper delivers to: Kafka (aiokafka) for a spoke, a JSONL file when embedded.

Each raises SinkUnavailable for anything that means "not delivered, try again later";
the spool keeps the events meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, UnknownError

from gateway.errors import SinkUnavailable

Record = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers


class Producer(Protocol):
    async def send_batch(self, records: list[Record]) -> None: ...

    async def close(self) -> None: ...


def kafka_unavailable(bootstrap: str, exc: BaseException, idempotence: bool
                      ) -> SinkUnavailable:
    """What Kafka said; for an idempotent producer refused with an unknown error (Tansu's
    answer to aiokafka's InitProducerId, docs/kafka-broker.md), also the setting to change:
    `kafka 127.0.0.1:N: UnknownError()` alone left an operator guessing."""
    hint = (" (a broker without idempotent producers, such as Tansu: set "
            "GATEWAY_KAFKA_IDEMPOTENCE=false)"
            if idempotence and isinstance(exc, UnknownError) else "")
    return SinkUnavailable(f"kafka {bootstrap}: {exc!r}{hint}")


class KafkaProducer:
    """acks=all; the idempotent producer where the broker supports it (a setting: Tansu
    rejects aiokafka's InitProducerId v0, see docs/kafka-broker.md)."""

    def __init__(self, bootstrap: str, topic: str, idempotence: bool = True) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.idempotence = idempotence
        self._producer: AIOKafkaProducer | None = None

    async def _started(self) -> AIOKafkaProducer:
        if self._producer is None:
            p = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap, acks="all", linger_ms=5,
                enable_idempotence=self.idempotence, request_timeout_ms=10000,
                retry_backoff_ms=200, max_batch_size=1 << 20)
            try:
                await p.start()
            except (KafkaError, OSError) as exc:
                await p.stop()
                raise kafka_unavailable(self.bootstrap, exc, self.idempotence) from exc
            self._producer = p
        return self._producer

    async def send_batch(self, records: list[Record]) -> None:
        """One aiokafka batch per partition (more when one fills up), each record on the
        partition aiokafka's default partitioner gives its key: `send()` per record cost a
        coroutine, a future and a partitioner call per event (~25 µs of the sidecar's CPU)."""
        p = await self._started()
        try:
            parts = sorted(await p.partitions_for(self.topic))
            n = len(parts)
            by_part: dict[int, list[Record]] = {}
            for r in records:
                part = parts[(murmur2(r[0]) & 0x7FFFFFFF) % n] if n > 1 else parts[0]
                by_part.setdefault(part, []).append(r)
            futures = []
            for part, recs in by_part.items():
                batch = p.create_batch()
                for k, v, h in recs:
                    if batch.append(key=k, value=v, timestamp=None, headers=h) is None:
                        futures.append(await p.send_batch(batch, self.topic, partition=part))
                        batch = p.create_batch()
                        if batch.append(key=k, value=v, timestamp=None, headers=h) is None:
                            raise SinkUnavailable(f"kafka: an event of {len(v)} bytes "
                                                  "does not fit a batch")
                batch.close()  # complete: no linger
                futures.append(await p.send_batch(batch, self.topic, partition=part))
            await asyncio.gather(*futures)
        except (KafkaError, OSError) as exc:
            # A producer that lost its broker can wedge; start a fresh one next time.
            self._producer = None
            await p.stop()
            raise kafka_unavailable(self.bootstrap, exc, self.idempotence) from exc

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None


_M = 0x5BD1E995


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (aiokafka.partitioner.murmur2, the Java client's), the same value in
    half its time: the words unpacked at once, not byte by byte (a test keeps them equal)."""
    n = len(data)
    h = 0x9747B28C ^ n
    n4 = n & ~3
    for (k,) in struct.iter_unpack("<I", data[:n4]):
        k = (k * _M) & 0xFFFFFFFF
        k ^= k >> 24
        h = ((h * _M) & 0xFFFFFFFF) ^ ((k * _M) & 0xFFFFFFFF)
    extra = n & 3
    if extra >= 3:
        h ^= data[n4 + 2] << 16
    if extra >= 2:
        h ^= data[n4 + 1] << 8
    if extra:
        h = ((h ^ data[n4]) * _M) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * _M) & 0xFFFFFFFF
    return h ^ (h >> 15)


class JsonlProducer:
    """Embedded mode: one JSON event per line, appended and fsynced."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    async def send_batch(self, records: list[Record]) -> None:
        data = b"".join(v + b"\n" for _, v, _ in records)
        try:
            await asyncio.to_thread(self._append, data)
        except OSError as exc:
            raise SinkUnavailable(f"{self.path}: {exc}") from exc

    def _append(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    async def close(self) -> None:
        return None
