"""The mock engine's request plumbing, shared by its OpenAI and Anthropic handlers: the
pace and failure headers, the body, one generation on the engine's clock (dying on purpose
where a header says), the stats every request updates, and an SSE stream that remembers
the usage the client received."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.typedefs import Handler

from devspoke import mock_tokens as mt
from devspoke.errors import Died, RequestError
from devspoke.mock_tokens import Job, MockStats, Pace


@dataclass
class MockConfig:
    ttft_ms: float = 20.0
    tokens_per_s: float = 500.0  # 0 means no delay between tokens
    default_max_tokens: int = 16


CONFIG = web.AppKey("config", MockConfig)
STATS = web.AppKey("stats", MockStats)
# The usage this request told the client: later usage objects update earlier ones (as
# Anthropic's message_delta updates message_start's).
USAGE = web.RequestKey("usage", dict)


# The paths x-mock-status and the stats apply to: the API, and vLLM's /tokenize (testkit's
# policy lets it through as a pass-through path)
API_PATHS = ("/v1/", "/tokenize")
NO_BODY = (204, 304)  # statuses whose answer has no body (RFC 9110)


def error(request: web.Request, status: int, message: str) -> web.Response:
    """OpenAI's error shape, or Anthropic's on the Messages API; a 204 or 304 has none, nor
    any status with x-mock-empty (content-length: 0: an empty 200, a bare 500)."""
    if status in NO_BODY or 100 <= status < 200 or "x-mock-empty" in request.headers:
        return web.Response(status=status)
    if request.path.startswith("/v1/messages"):
        return web.json_response(mt.anthropic_error(status, message), status=status)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status)


def header_number(request: web.Request, name: str) -> float | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise RequestError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise RequestError(f"{name} must be a non-negative number, got {raw!r}")
    return value


def pace(request: web.Request) -> Pace:
    cfg = request.app[CONFIG]
    ttft_ms = header_number(request, "x-mock-ttft-ms")
    tps = header_number(request, "x-mock-tokens-per-s")
    tps = cfg.tokens_per_s if tps is None else tps
    cut = header_number(request, "x-mock-cut-after")
    fail = header_number(request, "x-mock-fail-after")
    die_after = cut if cut is not None else fail
    return Pace(
        ttft_s=(cfg.ttft_ms if ttft_ms is None else ttft_ms) / 1000.0,
        gap_s=1.0 / tps if tps > 0 else 0.0,
        die_after=None if die_after is None else int(die_after),
        reset=cut is not None,
    )


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count every API request in and out (even cut or abandoned ones) and map errors."""
    if not request.path.startswith(API_PATHS):
        return await handler(request)
    stats = request.app[STATS]
    stats.enter(request.headers)
    try:
        forced = header_number(request, "x-mock-status")
        if forced is None:
            return await handler(request)
        # Read the request first, as an engine does, unless x-mock-early says answer before
        # reading it (as an engine or a proxy refusing a request by its headers alone)
        if "x-mock-early" not in request.headers:
            await request.read()
        if not 100 <= forced < 600:
            raise RequestError(f"x-mock-status must be an HTTP status, got {forced:g}")
        return error(request, int(forced), f"mock engine failure (x-mock-status: {int(forced)})")
    except RequestError as exc:
        return error(request, 400, str(exc))
    finally:
        stats.leave(request.get(USAGE))


async def read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise RequestError(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("you must provide a model parameter")
    request.app[STATS].models.add(model)
    return body


def new_job(
    request: web.Request,
    body: dict[str, Any],
    prefix: str,
    prompt: int,
    budget: tuple[int, bool] | None = None,
) -> Job:
    """One generation; `budget` (tokens, client-limited) defaults to the OpenAI fields'."""
    cfg = request.app[CONFIG]
    n, limited = budget or mt.completion_budget(body, cfg.default_max_tokens)
    return Job(
        id=prefix + secrets.token_hex(12),
        model=body["model"],
        created=int(time.time()),
        prompt=prompt,
        n=n,
        finish="length" if limited else "stop",
        pace=pace(request),
    )


def die(request: web.Request, reset: bool) -> NoReturn:
    """Drop the connection mid-body, as a crashed engine would: no final chunk, no [DONE]."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if reset and sock is not None and transport.get_write_buffer_size() == 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()  # RST: nothing is left unsent, so nothing sent is lost
        else:
            transport.close()  # FIN after flushing what was already written
    raise Died


async def tokens(request: web.Request, job: Job) -> AsyncIterator[int]:
    """Yield token indices on the engine's clock, dying at the injected failure point."""
    die_after = job.pace.die_after
    for i in range(job.n):
        if i == die_after:
            die(request, job.pace.reset)
        delay = job.pace.ttft_s if i == 0 else job.pace.gap_s
        if delay > 0 or i % 1024 == 0:  # unpaced: give the loop a turn now and then, not per token
            await asyncio.sleep(delay)
        yield i
    if die_after is not None and die_after >= job.n:
        die(request, job.pace.reset)


async def generate(request: web.Request, job: Job) -> bool:
    """Run a non-streamed generation; False if the engine died (nothing can be answered)."""
    try:
        async for _ in tokens(request, job):
            pass
    except Died:
        return False
    return True


def compressing(request: web.Request, resp: web.StreamResponse) -> None:
    """x-mock-compress: compress the answer when the request accepts it (Accept-Encoding), as
    an engine behind a gzip middleware or proxy does."""
    if request.headers.get("x-mock-compress"):
        resp.enable_compression()


def reply(request: web.Request, payload: dict[str, Any]) -> web.Response:
    request[USAGE] = payload["usage"]
    resp = web.json_response(payload)
    compressing(request, resp)
    return resp


class Sse:
    """An open event stream that remembers the last usage the client actually received."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        headers = {"content-type": "text/event-stream", "cache-control": "no-cache"}
        self.resp = web.StreamResponse(headers=headers)
        compressing(request, self.resp)
        self.seq = 0

    async def send(self, data: dict[str, Any] | str, event: str | None = None) -> None:
        if not self.resp.prepared:
            await self.resp.prepare(self.request)
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        head = f"event: {event}\n" if event else ""
        await self.resp.write(f"{head}data: {text}\n\n".encode())
        if isinstance(data, dict):
            inner = data.get("response") or data.get("message") or {}
            usage = data.get("usage") or inner.get("usage")
            if usage:
                self.request[USAGE] = {**self.request.get(USAGE, {}), **usage}

    async def event(self, kind: str, **fields: Any) -> None:
        """A Responses-API event: typed, numbered, and named on the `event:` line."""
        await self.send({"type": kind, **fields, "sequence_number": self.seq}, event=kind)
        self.seq += 1


def header_count(request: web.Request, name: str) -> int | None:
    value = header_number(request, name)
    return None if value is None else int(value)
