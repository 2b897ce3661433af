"""The floor for an HTTP ext_authz: a server that answers every request on a keep-alive
HTTP/1.1 connection with a constant `200 OK` (no headers to add), reading only as far as
the request's end (its head's content-length). What Envoy's ext_authz over HTTP costs
before any Check runs (benchmarks/bench_latency.py --floor).

    python benchmarks/ok_server.py PORT [uvloop|thread] [ANSWER_FILE]

`uvloop`: an asyncio Protocol on uvloop, as the sidecar's door runs; `thread`: a blocking
socket per connection on its own thread (no event loop between the wake-up and the answer).
ANSWER_FILE: the whole answer to send instead (e.g. one the sidecar's door gave, with its
headers and metadata), to see what Envoy's handling of them costs.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


def _complete(buf: bytearray) -> int:
    """The length of the first whole request in buf, or 0."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0
    head = bytes(buf[:end]).lower()
    at = head.find(b"content-length:")
    length = int(head[at + 15:].split(b"\r\n")[0]) if at >= 0 else 0
    return end + 4 + length if len(buf) >= end + 4 + length else 0


class _Ok(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while n := _complete(self.buf):
            del self.buf[:n]
            self.transport.write(OK)  # type: ignore[attr-defined]


async def _serve_uvloop(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Ok, "127.0.0.1", port)
    await server.serve_forever()


def _serve_thread(port: int) -> None:
    lsock = socket.create_server(("127.0.0.1", port))

    def conn(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        while data := sock.recv(65536):
            buf += data
            while n := _complete(buf):
                del buf[:n]
                sock.sendall(OK)

    while True:
        s, _ = lsock.accept()
        threading.Thread(target=conn, args=(s,), daemon=True).start()


if __name__ == "__main__":
    port, mode = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "uvloop")
    if len(sys.argv) > 3:
        with open(sys.argv[3], "rb") as f:
            OK = f.read()
    if mode == "thread":
        _serve_thread(port)
    else:
        import uvloop
        uvloop.run(_serve_uvloop(port))
