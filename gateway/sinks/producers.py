"""Sinks the shipper delivers to: Kafka (aiokafka) for a spoke, a JSONL file when embedded.

Each raises SinkUnavailable for anything that means "not delivered, try again later";
the spool keeps the events meanwhile.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from gateway.errors import SinkUnavailable

Record = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers


class Producer(Protocol):
    async def send_batch(self, records: list[Record]) -> None: ...

    async def close(self) -> None: ...


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
                raise SinkUnavailable(f"kafka {self.bootstrap}: {exc!r}") from exc
            self._producer = p
        return self._producer

    async def send_batch(self, records: list[Record]) -> None:
        p = await self._started()
        try:
            futures = [await p.send(self.topic, value=v, key=k, headers=h) for k, v, h in records]
            await asyncio.gather(*futures)
        except (KafkaError, OSError) as exc:
            # A producer that lost its broker can wedge; start a fresh one next time.
            self._producer = None
            await p.stop()
            raise SinkUnavailable(f"kafka {self.bootstrap}: {exc!r}") from exc

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None


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
