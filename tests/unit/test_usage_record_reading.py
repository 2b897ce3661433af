"""What `usage consume` makes of one record: an event to bill, or a quarantined record with
its reason logged. Token counts are integers (proto3 JSON int64: strings), never floats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.structs import ConsumerRecord

from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.billing.consumer import read_record
from gateway.billing.db import Rejected
from gateway.log import configure
from gateway.sinks.usage_proto import proto_json


def good() -> dict[str, Any]:
    return orjson.loads(proto_json(usage_pb2.UsageEvent(
        event_id="e1", instance_id="i1", seq=1, ended_at="2026-12-01T10:00:00.000Z",
        team="t", key_id="k", model="m", outcome="completed", usage_source="reported",
        cost=0.25, usage=usage_pb2.Usage(prompt_tokens=9007199254740993, completion_tokens=2,
                                         total_tokens=9007199254740995))))


def record(value: dict[str, Any] | bytes) -> ConsumerRecord[bytes, bytes]:
    raw = value if isinstance(value, bytes) else orjson.dumps(value)
    return ConsumerRecord("llm.usage.v1", 2, 17, 0, 0, b"e1", raw, None, 2, len(raw), ())


def test_big_counts_as_strings_are_exact_and_a_future_versions_extra_fields_are_kept() -> None:
    e = good()
    e["schema_minor"] = 2  # a later version's fields, top-level and nested: still billed
    e["usage"]["audio_tokens"] = "7"
    e["timing"] = {"queue_ms": 1.5, "ttft_ms": 3.0}
    got = read_record(record(e))
    assert isinstance(got, usage_pb2.UsageEvent)
    assert got.usage.prompt_tokens == 9007199254740993  # past 2**53: a float would round it
    assert (got.event_id, got.cost) == ("e1", 0.25)


@pytest.mark.parametrize(("field", "value", "word"), [
    ("prompt_tokens", 9007199254740993.0, "not an integer"),  # 2**53 + 1: read as ...992
    ("prompt_tokens", "9007199254740993.0", "not an integer"),
    ("completion_tokens", 10.5, "parse integer"),
    ("total_tokens", "1e3", "not an integer"),
    ("cached_tokens", True, "bool"),
])
def test_a_token_count_that_is_no_integer_is_quarantined(
        field: str, value: object, word: str, capsys: pytest.CaptureFixture[str]) -> None:
    configure("info", cache=False)
    e = good()
    e["usage"][field] = value
    got = read_record(record(e))
    assert isinstance(got, Rejected), got
    assert word.lower() in got.error.lower() and (got.partition, got.offset) == (2, 17)
    err = capsys.readouterr().err
    assert "usage_record_unreadable" in err and '"offset": 17' in err


@pytest.mark.parametrize(("value", "word"), [
    (b"not json", "json"), (b'{"event_id": 5}', "event_id"), (b"[]", "event_id"),
])
def test_poison_is_quarantined_with_its_reason(value: bytes, word: str) -> None:
    got = read_record(record(value))
    assert isinstance(got, Rejected) and word in got.error.lower(), got


def test_a_negative_cost_is_quarantined() -> None:
    e = good()
    e["cost"] = -3.5  # it would take money off the team's bill
    got = read_record(record(e))
    assert isinstance(got, Rejected) and "cost" in got.error, got


def test_a_consumer_that_cannot_be_built_closes_its_database(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The database opened for a consume is closed when its consumer cannot even be built."""
    import asyncio

    from gateway.billing import consumer as consumer_mod

    closed: list[bool] = []
    real = consumer_mod.UsageDb

    class Db(real):  # type: ignore[misc,valid-type]
        def close(self) -> None:
            closed.append(True)
            super().close()

    def broken(*_: object, **__: object) -> None:
        raise ValueError("no consumer")

    monkeypatch.setattr(consumer_mod, "UsageDb", Db)
    monkeypatch.setattr(consumer_mod, "usage_consumer", broken)
    with pytest.raises(ValueError, match="no consumer"):
        asyncio.run(consumer_mod.consume("127.0.0.1:1", "t", f"sqlite:///{tmp_path / 'u.db'}"))
    assert closed == [True]
