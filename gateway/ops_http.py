"""The operators' endpoints (/metrics, /healthz, /readyz): a tiny HTTP/1.1 server, no
framework. Shared by `gateway serve` (gateway/server/app.py, workers.py) and `gateway policy
sync` (gateway/hub/sync.py), so neither imports the other."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.metrics_core import Metric

Handler = Callable[[], Awaitable[tuple[int, str, bytes]]]

_REASONS = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}


async def metrics_handler() -> tuple[int, str, bytes]:
    """/metrics; merged across `GATEWAY_WORKERS` processes (prometheus' multiprocess mode)."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return 200, prometheus_client.CONTENT_TYPE_LATEST, generate_latest(registry)
    return 200, prometheus_client.CONTENT_TYPE_LATEST, generate_latest()


class _Without:
    """The default registry without some metric families."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def collect(self) -> Iterator[Metric]:
        return (m for m in prometheus_client.REGISTRY.collect() if m.name not in self.names)


async def syncer_metrics_handler() -> tuple[int, str, bytes]:
    """/metrics of `gateway policy sync`: its own and the shared ones, not a sidecar's gauges."""
    from gateway.metrics import SIDECAR_GAUGES
    return 200, prometheus_client.CONTENT_TYPE_LATEST, generate_latest(_Without(SIDECAR_GAUGES))


async def healthz() -> tuple[int, str, bytes]:
    return 200, "text/plain", b"ok\n"


async def serve_http(host: str, port: int, routes: dict[str, Handler]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            parts = line.decode("latin-1").split()
            path = parts[1].partition("?")[0] if len(parts) >= 2 else ""
            handler = routes.get(path)
            if handler is None:
                status, ctype, body = 404, "text/plain", b"not found\n"
            else:
                status, ctype, body = await handler()
            writer.write(
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\ncontent-type: {ctype}\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port, reuse_address=True)
