"""A broker that refuses the idempotent producer with an unknown error (Tansu, the dev
spoke's Kafka) is named with the setting that fixes it: `hub publish` once said only
`error: kafka 127.0.0.1:N: UnknownError()`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, UnknownError

from gateway.errors import SinkUnavailable
from gateway.hub import topics
from gateway.sinks import producers


class _Refused:
    def __init__(self, exc: Exception, **kw: Any) -> None:
        self.exc = exc

    async def start(self) -> None:
        raise self.exc

    async def stop(self) -> None:
        pass


HINT = "GATEWAY_KAFKA_IDEMPOTENCE=false"


@pytest.mark.parametrize("exc, idempotence, hinted", [
    (UnknownError(), True, True),
    (UnknownError(), False, False),  # already off: the hint would mislead
    (KafkaConnectionError(), True, False),  # a broker that is down is just down
])
def test_the_hub_producer_names_the_setting(monkeypatch: pytest.MonkeyPatch, exc: Exception,
                                            idempotence: bool, hinted: bool) -> None:
    monkeypatch.setattr(topics, "AIOKafkaProducer", lambda **kw: _Refused(exc, **kw))
    with pytest.raises(SinkUnavailable) as got:
        asyncio.run(topics.produce("127.0.0.1:1", "llm.policy.v1", "*", b"{}",
                                   idempotence=idempotence))
    assert (HINT in str(got.value)) is hinted, got.value
    assert str(got.value).startswith("kafka 127.0.0.1:1: ")


def test_the_usage_and_status_producer_names_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producers, "AIOKafkaProducer", lambda **kw: _Refused(UnknownError()))
    p = producers.KafkaProducer("127.0.0.1:1", "llm.usage.v1", idempotence=True)
    with pytest.raises(SinkUnavailable, match=HINT):
        asyncio.run(p.send_batch([(b"k", b"v", [])]))
