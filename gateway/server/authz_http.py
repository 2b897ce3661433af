"""ext_authz over HTTP/1.1 (Envoy's `http_service`): the Check through a door that costs a
fraction of a gRPC call (gateway/server/check_http.py says why and what the answer
carries).

Envoy's HTTP client sends one request at a time per keep-alive connection: the request's
method and path, the headers ext_authz allows, `content-length` and the whole body. Nothing
else is spoken: no chunked bodies, no pipelining beyond reading requests in order, no
`Expect: 100-continue`. A request this parser cannot read gets no decision: its connection
closes with a 500, which Envoy, like any failure of the door, turns into its
`status_on_error` 503 (fail closed).
A connection closed while its decision is pending is Envoy giving up on the Check (its
client left, or its timeout passed): the decision is cancelled and its admission undone,
as with a cancelled gRPC Check.
"""

from __future__ import annotations

import asyncio

from gateway.authz.check import Check
from gateway.authz.request import AuthzRequest
from gateway.log import log
from gateway.server import check_http

MAX_HEAD = 64 * 1024
# Envoy reads any 5xx from the door as the door failing: its status_on_error (503).
_FAILED = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE = (b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n"
              b"connection: close\r\n\r\n")


class BadRequest(ValueError):
    pass


def parse_head(head: bytes) -> tuple[str, str, dict[str, str], int]:
    """(method, target, headers with lower-case names, content-length) of a request head
    (without its blank line). Repeated headers are joined with "," as in a CheckRequest."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise BadRequest("not an HTTP/1.x request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header line")
        k, v = name.decode("latin-1").lower(), value.strip().decode("latin-1")
        headers[k] = f"{headers[k]},{v}" if k in headers else v
    if "transfer-encoding" in headers:
        raise BadRequest("chunked bodies are not spoken here")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit()):
        raise BadRequest("bad content-length")
    return parts[0].decode("latin-1"), parts[1].decode("latin-1"), headers, int(length)


class _Connection(asyncio.Protocol):
    def __init__(self, check: Check, max_body: int) -> None:
        self.check = check
        self.max_body = max_body
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.pending: asyncio.Task[None] | None = None
        # a request's head, read once while its body is still coming: method, path, headers,
        # content-length
        self.head: tuple[str, str, dict[str, str], int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.pending is None:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pending is not None:
            self.pending.cancel()

    def _next(self) -> None:
        if self.head is None:  # read once; a large body then only grows the buffer
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._close(_FAILED)
                return
            try:
                method, target, headers, length = parse_head(bytes(self.buf[:end]))
            except (BadRequest, UnicodeDecodeError) as exc:
                log.warning("authz_http_bad_request", error=str(exc))
                self._close(_FAILED)
                return
            if length > self.max_body:
                self._close(_TOO_LARGE)
                return
            del self.buf[:end + 4]
            self.head = method, target.partition("?")[0], headers, length
        method, path, headers, length = self.head
        if len(self.buf) < length:
            return
        body = bytes(self.buf[:length])
        del self.buf[:length]
        self.head = None
        req = AuthzRequest(request_id=headers.get("x-request-id", ""), method=method, path=path,
                           headers=headers, body=body)
        self.pending = asyncio.get_running_loop().create_task(self._answer(req))

    async def _answer(self, req: AuthzRequest) -> None:
        try:
            out = check_http.encode(await self.check(req))
        except asyncio.CancelledError:
            return
        except Exception:  # a bug: Envoy answers its 503 (fail closed), the log says why
            log.exception("authz_http_failed", request_id=req.request_id)
            self._close(_FAILED)
            return
        finally:
            self.pending = None
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(out)
            if self.buf:
                self._next()

    def _close(self, answer: bytes) -> None:
        assert self.transport is not None
        self.transport.write(answer)
        self.transport.close()


async def serve(check: Check, host: str, port: int, max_body: int) -> asyncio.Server:
    """The HTTP door on host:port (SO_REUSEPORT, like the gRPC port: GATEWAY_WORKERS)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(check, max_body), host, port,
                                    reuse_port=True, backlog=1024)
