"""Envoy's records over OTLP/HTTP (gateway/server/records_http.py): what is not a readable
OTLP logs batch is answered with a clear 4xx and records nothing; a batch is answered 200
only once its events are durable in a real spool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.metering.recorder import Recorder
from gateway.server import records_http
from gateway.server.http1 import BadRequest
from gateway.server.records_http import Request, read_request
from gateway.server.records_service import RecordsService
from gateway.sinks.spool import Spool

AUTHZ = {"request_id": "r1", "key_id": "k", "team": "t", "model": "m", "stream": False,
         "leased": True, "endpoint": "/v1/chat/completions", "prompt_estimate": 12}
ATTRS = {"rid": "r1", "path": "/v1/chat/completions", "code": "200", "flags": "-",
         "details": "via_upstream", "start": "1800000000.250000", "duration_us": "1500",
         "authz": orjson.dumps(AUTHZ).decode(),
         "usage": orjson.dumps({"prompt_tokens": 9, "completion_tokens": 10}).decode()}


def batch(*rids: str) -> bytes:
    req = otlp.ExportLogsServiceRequest()
    records = req.resource_logs.add().scope_logs.add()
    for rid in rids:
        lr = records.log_records.add()
        for k, v in {**ATTRS, "rid": rid}.items():
            kv = lr.attributes.add()
            kv.key, kv.value.string_value = k, v
    return req.SerializeToString()


def post(body: bytes, path: str = "/v1/logs", content_type: str = "application/x-protobuf",
         method: str = "POST") -> Request:
    return Request(method, path, {"content-type": content_type}, body)


@pytest.fixture
async def records(tmp_path: Path) -> AsyncIterator[tuple[RecordsService, Spool]]:
    spool = Spool(tmp_path, "i").open()
    ledger = Ledger(MemoryLimiter(), SystemClock(), 30.0)
    ledger.start()
    yield RecordsService(Recorder(spool, "s", ledger), ledger), spool
    await ledger.stop()


@pytest.mark.parametrize(("req", "status"), [
    (post(batch("r1"), path="/v1/chat/completions"), b"404"),
    (post(batch("r1"), path="/"), b"404"),
    (post(batch("r1"), method="GET"), b"405"),
    (post(batch("r1"), content_type="application/json"), b"415"),
    (post(batch("r1"), content_type=""), b"415"),
    (post(b"\xff\xff\xff garbage"), b"400"),
])
async def test_what_is_not_a_logs_batch_is_refused_and_records_nothing(
        records: tuple[RecordsService, Spool], req: Request, status: bytes) -> None:
    service, spool = records
    out = await records_http.answer(service, req)
    assert out.startswith(b"HTTP/1.1 " + status)
    assert out.rstrip().split(b"\r\n\r\n", 1)[1]  # a body that says why
    assert spool.last_seq == 0


async def test_a_batch_is_answered_only_once_durable(
        records: tuple[RecordsService, Spool]) -> None:
    service, spool = records
    answering = asyncio.create_task(records_http.answer(
        service, post(batch("r1", "r2"), content_type="application/x-protobuf; charset=x")))
    await asyncio.sleep(0.05)
    assert not answering.done() and spool.last_seq == 2  # recorded, not yet on disk
    writer = asyncio.create_task(spool.run_writer())
    try:
        out = await asyncio.wait_for(answering, 5)
        assert out.startswith(b"HTTP/1.1 200 ") and spool.durable_seq >= 2
        # the same batch again (as a retry would): nothing recorded twice
        await records_http.answer(service, post(batch("r1", "r2")))
        assert spool.last_seq == 2
    finally:
        writer.cancel()


def test_a_chunked_body_is_read_whole_and_only_when_complete() -> None:
    """Envoy's exporter sends its body chunked, without a content-length."""
    body = batch("r1")
    wire = (b"POST /v1/logs HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-protobuf\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + f"{len(body[:10]):x}\r\n".encode() + body[:10] + b"\r\n"
            + f"{len(body[10:]):x};ext=1\r\n".encode() + body[10:] + b"\r\n0\r\n\r\n")
    for cut in range(len(wire)):
        assert read_request(wire[:cut], 1 << 20) is None
    got = read_request(wire + b"GET /next", 1 << 20)
    assert got is not None
    req, taken = got
    assert (req.method, req.path, req.body, taken) == ("POST", "/v1/logs", body, len(wire))


def test_a_content_length_body_is_read() -> None:
    wire = b"POST /v1/logs?x=1 HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc"
    assert read_request(wire[:-1], 100) is None
    got = read_request(wire, 100)
    assert got is not None and got[0].path == "/v1/logs" and got[0].body == b"abc"


@pytest.mark.parametrize("wire", [
    b"NOT HTTP\r\n\r\n",
    b"POST /v1/logs HTTP/1.1\r\nno colon\r\n\r\n",
    b"POST /v1/logs HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
    b"POST /v1/logs HTTP/1.1\r\ncontent-length: 101\r\n\r\n",
    b"POST /v1/logs HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n",
    b"POST /v1/logs HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/logs HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n65\r\n" + b"a" * 101,
    b"POST /v1/logs HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc",
])
def test_what_is_not_http_is_a_bad_request(wire: bytes) -> None:
    with pytest.raises(BadRequest):
        read_request(wire, 100)


async def test_over_a_connection(records: tuple[RecordsService, Spool]) -> None:
    """Two requests on one keep-alive connection; then garbage closes it with a 400."""
    service, spool = records
    writer_task = asyncio.create_task(spool.run_writer())
    server = await records_http.serve(service, "127.0.0.1", 0, 1 << 20)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for rid in ("a", "b"):
            body = batch(rid)
            writer.write(b"POST /v1/logs HTTP/1.1\r\ncontent-type: application/x-protobuf\r\n"
                         b"transfer-encoding: chunked\r\n\r\n"
                         + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 ")
        assert spool.durable_seq == 2
        writer.write(b"garbage\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)  # then the connection closes
        assert answer.startswith(b"HTTP/1.1 400 ")
        writer.close()
    finally:
        server.close()
        writer_task.cancel()


async def test_an_attribute_of_another_kind_is_read_as_its_text(
        records: tuple[RecordsService, Spool]) -> None:
    """Envoy sends strings; a record whose code came as an int (another exporter) reads
    the same."""
    service, spool = records
    req = otlp.ExportLogsServiceRequest.FromString(batch("r9"))
    lr = req.resource_logs[0].scope_logs[0].log_records[0]
    for kv in lr.attributes:
        if kv.key == "code":
            kv.value.int_value = 200
    writer = asyncio.create_task(spool.run_writer())
    try:
        await service.export(req)
    finally:
        writer.cancel()
    assert spool.last_seq == 1
    line = (spool.dir / "00000000000000000001.log").read_bytes()
    assert orjson.loads(line)["status_code"] == 200
