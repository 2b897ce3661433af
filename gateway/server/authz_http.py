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
from collections.abc import Coroutine, Generator
from typing import Any

from gateway.authz.check import Answer, Check
from gateway.authz.request import AuthzRequest
from gateway.log import log
from gateway.server import check_http, http1
from gateway.server.http1 import MAX_HEAD, BadRequest

# Envoy reads any 5xx from the door as the door failing: its status_on_error (503).
_FAILED = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE = (b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n"
              b"connection: close\r\n\r\n")

_waiting = 0  # Checks of this process waiting on the store (a Task each), all connections


def waiting() -> int:
    """How many Checks wait on the store now: a load gauge for the records batches."""
    return _waiting


def _done(_: asyncio.Task[None]) -> None:
    global _waiting
    _waiting -= 1


class _Started:
    """A coroutine already run to its first wait (`waiting`: what it yielded), for a Task to
    finish: the Task sees each wait exactly as if it had run the coroutine from its start,
    and its cancellation is thrown into the coroutine where it waits."""

    __slots__ = ("coro", "waiting")

    def __init__(self, coro: Coroutine[Any, Any, Answer], waiting: Any) -> None:
        self.coro = coro
        self.waiting = waiting

    def __await__(self) -> Generator[Any, None, Answer]:
        waiting = self.waiting
        while True:
            try:
                yield waiting
            except BaseException as exc:  # the Task's cancellation
                try:
                    waiting = self.coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    waiting = self.coro.send(None)
                except StopIteration as done:
                    return done.value


def parse_head(head: bytes) -> tuple[str, str, dict[str, str], int]:
    """(method, target, headers with lower-case names, content-length) of a Check's request
    head (without its blank line): Envoy's ext_authz client sends whole bodies only."""
    method, target, headers = http1.parse_head(head)
    if "transfer-encoding" in headers:
        raise BadRequest("chunked bodies are not spoken here")
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit()):
        raise BadRequest("bad content-length")
    return method, target, headers, int(length)


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
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pending is not None:
            self.pending.cancel()

    def _next(self) -> None:
        """Answer the requests the buffer holds, in order, while none is pending."""
        assert self.transport is not None
        while self.pending is None and not self.transport.is_closing():
            req = self._request()
            if req is None:
                return
            self._start(req)

    def _request(self) -> AuthzRequest | None:
        """The buffer's next whole request, or None (incomplete, or its connection closed)."""
        if self.head is None:  # read once; a large body then only grows the buffer
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._close(_FAILED)
                return None
            try:
                method, target, headers, length = parse_head(bytes(self.buf[:end]))
            except (BadRequest, UnicodeDecodeError) as exc:
                log.warning("authz_http_bad_request", error=str(exc))
                self._close(_FAILED)
                return None
            if length > self.max_body:
                self._close(_TOO_LARGE)
                return None
            del self.buf[:end + 4]
            self.head = method, target.partition("?")[0], headers, length
        method, path, headers, length = self.head
        if len(self.buf) < length:
            return None
        body = bytes(self.buf[:length])
        del self.buf[:length]
        self.head = None
        return AuthzRequest(request_id=headers.get("x-request-id", ""), method=method, path=path,
                            headers=headers, body=body)

    def _start(self, req: AuthzRequest) -> None:
        """Run the Check up to its first wait. Most never wait (a denial, or an allow with no
        limits to admit): answered here, with no Task and no loop tick. One that waits (the
        admission's Redis round trip) is finished by a Task. Until its first wait the Check
        runs outside any Task: nothing on its path may use asyncio.timeout() (or
        current_task()) before that wait."""
        coro = self.check(req)
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            self._write(req, done.value)
            return
        except Exception:
            self._failed(req)
            return
        global _waiting
        self.pending = asyncio.get_running_loop().create_task(
            self._finish(req, _Started(coro, waiting)))
        _waiting += 1  # a done callback, not a `finally`: a Task cancelled unstarted runs none
        self.pending.add_done_callback(_done)

    async def _finish(self, req: AuthzRequest, check: _Started) -> None:
        try:
            answer = await check
        except asyncio.CancelledError:
            return
        except Exception:
            self._failed(req)
            return
        finally:
            self.pending = None
        assert self.transport is not None
        if not self.transport.is_closing():
            self._write(req, answer)
            self._next()

    def _write(self, req: AuthzRequest, answer: Answer) -> None:
        assert self.transport is not None
        try:
            out = check_http.encode(answer)
        except Exception:
            self._failed(req)
            return
        self.transport.write(out)

    def _failed(self, req: AuthzRequest) -> None:
        """A bug: Envoy answers its 503 (fail closed), the log says why."""
        log.exception("authz_http_failed", request_id=req.request_id)
        self._close(_FAILED)

    def _close(self, answer: bytes) -> None:
        assert self.transport is not None
        self.transport.write(answer)
        self.transport.close()


async def serve(check: Check, host: str, port: int, max_body: int) -> asyncio.Server:
    """The HTTP door on host:port (SO_REUSEPORT, like the gRPC port: GATEWAY_WORKERS)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(check, max_body), host, port,
                                    reuse_port=True, backlog=1024)
