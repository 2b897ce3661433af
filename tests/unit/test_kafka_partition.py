"""The producer's murmur2 is Kafka's: an event lands on the partition aiokafka's default
partitioner (and the Java client's) gives its key."""

from __future__ import annotations

import random

from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from gateway.sinks.producers import murmur2


def test_murmur2_is_aiokafkas_for_every_length_and_byte() -> None:
    rng = random.Random(26)
    keys = [bytes(rng.randrange(256) for _ in range(n)) for n in range(0, 80) for _ in range(40)]
    keys += [b"", b"\xff" * 7, b"\x00" * 9, b"21f6ae6c-5f5b-4bb2-9d1c-1b6a2f0f3e11"]
    for k in keys:
        assert murmur2(k) == aiokafka_murmur2(k), k
