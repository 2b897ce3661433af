"""Envoy's per-request records over OTLP/HTTP (`http_service` of its OpenTelemetry access
logger): `POST /v1/logs`, an `ExportLogsServiceRequest` as `application/x-protobuf`, on a
listener of its own (GATEWAY_RECORDS_HTTP_LISTEN).

Why: the records' gRPC costs the sidecar's event-engine thread more per request than the
batch's decoding; plain HTTP/1.1 on the asyncio loop does not. Why not the default: Envoy
1.40 never retries an OTLP/HTTP export (a 5xx, a reset or a timeout drops the batch,
docs/envoy.md §6), so a sidecar killed mid-batch loses that batch's records, where the
gRPC logger sends it again. The batch is answered 200 only once its events are durable
(gateway/server/records_service.py, shared with the gRPC Export), as there.

Its own listener, not a path on the Check's door: the Check's requests carry the client's
path (a client could send `POST /v1/logs`), and Envoy's exporter sends its body chunked,
which the door's parser refuses by design. Nothing else is spoken: one request at a time
per keep-alive connection, a `content-length` or chunked body.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.log import log
from gateway.server.http1 import MAX_HEAD, BadRequest, parse_head
from gateway.server.records_service import RecordsService

PATH = "/v1/logs"  # OTLP/HTTP's logs path, which Envoy's exporter is pointed at
CONTENT_TYPE = "application/x-protobuf"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


def read_request(buf: bytes | bytearray, max_body: int) -> tuple[Request, int] | None:
    """The first whole request in `buf` and how many bytes it took; None if it is not all
    there yet. BadRequest for what is not HTTP/1.1 or is larger than `max_body`."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise BadRequest("request head too large")
        return None
    method, target, headers = parse_head(bytes(buf[:end]))
    start = end + 4
    if headers.get("transfer-encoding", "").lower() == "chunked":
        got = _chunked(buf, start, max_body)
        if got is None:
            return None
        body, taken = got
    elif "transfer-encoding" in headers:
        raise BadRequest("unsupported transfer-encoding")
    else:
        length = headers.get("content-length", "0")
        if not (length.isascii() and length.isdigit()) or int(length) > max_body:
            raise BadRequest("bad or too large content-length")
        if len(buf) < start + int(length):
            return None
        body, taken = bytes(buf[start:start + int(length)]), start + int(length)
    return Request(method, target.partition("?")[0], headers, body), taken


def _chunked(buf: bytes | bytearray, at: int, max_body: int) -> tuple[bytes, int] | None:
    """A chunked body from `at`: (body, the offset past its end), None if incomplete."""
    body = bytearray()
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size_field = bytes(buf[at:eol]).partition(b";")[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise BadRequest("bad chunk size") from None
        if size < 0 or len(body) + size > max_body:
            raise BadRequest("chunk too large")
        at = eol + 2
        if size == 0:  # the last chunk, then trailers (Envoy sends none) and a blank line
            end = buf.find(b"\r\n\r\n", at - 2)
            return None if end < 0 else (bytes(body), end + 4)
        if len(buf) < at + size + 2:
            return None
        if buf[at + size:at + size + 2] != b"\r\n":
            raise BadRequest("chunk not followed by CRLF")
        body += buf[at:at + size]
        at += size + 2


def _response(status: str, body: bytes = b"", content_type: str = "text/plain") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


OK = _response("200 OK", otlp.ExportLogsServiceResponse().SerializeToString(), CONTENT_TYPE)
_FAILED = _response("500 Internal Server Error", b"the batch could not be recorded\n")


async def answer(records: RecordsService, req: Request) -> bytes:
    """The response to one request: 200 once its batch is durable; a 4xx, and nothing
    recorded, for anything but a readable OTLP logs batch."""
    if req.path != PATH:
        return _response("404 Not Found", f"only {PATH} is served here\n".encode())
    if req.method != "POST":
        return _response("405 Method Not Allowed", f"{PATH} takes POST\n".encode())
    if req.headers.get("content-type", "").partition(";")[0].strip().lower() != CONTENT_TYPE:
        return _response("415 Unsupported Media Type",
                         f"{PATH} takes {CONTENT_TYPE} (OTLP/HTTP protobuf)\n".encode())
    try:
        batch = otlp.ExportLogsServiceRequest.FromString(req.body)
    except DecodeError:
        return _response("400 Bad Request", b"the body is not an ExportLogsServiceRequest\n")
    await records.export(batch)
    return OK


class _Connection(asyncio.Protocol):
    def __init__(self, records: RecordsService, max_body: int) -> None:
        self.records = records
        self.max_body = max_body
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.pending: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.pending is None:
            self._next()

    def _next(self) -> None:
        assert self.transport is not None
        try:
            got = read_request(self.buf, self.max_body)
        except BadRequest as exc:
            log.warning("records_http_bad_request", error=str(exc))
            self.transport.write(_response("400 Bad Request", f"{exc}\n".encode()))
            self.transport.close()
            return
        if got is None:
            return
        req, taken = got
        del self.buf[:taken]
        self.pending = asyncio.get_running_loop().create_task(self._answer(req))

    async def _answer(self, req: Request) -> None:
        """Not cancelled when Envoy gives up (its timeout): the events are already in the
        spool, only the answer is late."""
        try:
            out = await answer(self.records, req)
        except Exception:
            log.exception("records_http_failed")
            out = _FAILED
        finally:
            self.pending = None
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(out)
            if self.buf:
                self._next()


async def serve(records: RecordsService, host: str, port: int, max_body: int) -> asyncio.Server:
    """The records' listener on host:port (SO_REUSEPORT, like the gRPC port: GATEWAY_WORKERS)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(records, max_body), host, port,
                                    reuse_port=True, backlog=1024)
