"""A mock OpenAI-compatible engine for `gateway dev` and the end-to-end tests.

It generates "tok0 tok1 ..." at a steady pace and reports honest usage (a token is a word; see
`mock_tokens`), so tests can check the gateway metered exactly what the engine reported.
Like vLLM and SGLang it also speaks Anthropic's Messages API (/v1/messages, streamed or not,
and /v1/messages/count_tokens), with Anthropic's usage, events and error shape.
Per-request headers steer it through Envoy: x-mock-ttft-ms, x-mock-tokens-per-s,
x-mock-cut-after (die after N tokens with a TCP reset), x-mock-fail-after (die after N tokens
with a plain close) and x-mock-status (answer that status with an OpenAI-shaped error, or an
Anthropic-shaped one on /v1/messages*). On /v1/messages only: x-mock-cache-read-tokens and
x-mock-cache-creation-tokens (how much of the prompt the cache served or stored) and
x-mock-error-after (after N tokens a stream ends with an `error` event, a plain answer is 529).
GET /mock/stats reports what the engine saw; POST /mock/reset zeroes it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.dev import mock_tokens as mt
from gateway.dev.mock_tokens import Job, MockStats, Pace, StreamOpts
from gateway.errors import Died, RequestError

DEFAULT_MODEL = "mock-model"


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


def _error(request: web.Request, status: int, message: str) -> web.Response:
    """OpenAI's error shape, or Anthropic's on the Messages API."""
    if request.path.startswith("/v1/messages"):
        return web.json_response(mt.anthropic_error(status, message), status=status)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status)


def _header_number(request: web.Request, name: str) -> float | None:
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


def _pace(request: web.Request) -> Pace:
    cfg = request.app[CONFIG]
    ttft_ms = _header_number(request, "x-mock-ttft-ms")
    tps = _header_number(request, "x-mock-tokens-per-s")
    tps = cfg.tokens_per_s if tps is None else tps
    cut = _header_number(request, "x-mock-cut-after")
    fail = _header_number(request, "x-mock-fail-after")
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
    if not request.path.startswith("/v1/"):
        return await handler(request)
    stats = request.app[STATS]
    stats.enter(request.headers)
    try:
        forced = _header_number(request, "x-mock-status")
        if forced is None:
            return await handler(request)
        if not 100 <= forced < 600:
            raise RequestError(f"x-mock-status must be an HTTP status, got {forced:g}")
        return _error(request, int(forced), f"mock engine failure (x-mock-status: {int(forced)})")
    except RequestError as exc:
        return _error(request, 400, str(exc))
    finally:
        stats.leave(request.get(USAGE))


async def _body(request: web.Request) -> dict[str, Any]:
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


def _job(
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
        pace=_pace(request),
    )


def _die(request: web.Request, reset: bool) -> NoReturn:
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


async def _tokens(request: web.Request, job: Job) -> AsyncIterator[int]:
    """Yield token indices on the engine's clock, dying at the injected failure point."""
    die_after = job.pace.die_after
    for i in range(job.n):
        if i == die_after:
            _die(request, job.pace.reset)
        await asyncio.sleep(job.pace.ttft_s if i == 0 else job.pace.gap_s)
        yield i
    if die_after is not None and die_after >= job.n:
        _die(request, job.pace.reset)


async def _generate(request: web.Request, job: Job) -> bool:
    """Run a non-streamed generation; False if the engine died (nothing can be answered)."""
    try:
        async for _ in _tokens(request, job):
            pass
    except Died:
        return False
    return True


def _reply(request: web.Request, payload: dict[str, Any]) -> web.Response:
    request[USAGE] = payload["usage"]
    return web.json_response(payload)


class Sse:
    """An open event stream that remembers the last usage the client actually received."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        headers = {"content-type": "text/event-stream", "cache-control": "no-cache"}
        self.resp = web.StreamResponse(headers=headers)
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


ChoiceFn = Callable[[str | None, str | None], dict[str, Any]]


async def _stream_choices(
    request: web.Request, job: Job, body: dict[str, Any], obj: str, choice: ChoiceFn
) -> web.StreamResponse:
    """Shared SSE loop of chat and legacy completions: tokens, finish, usage, [DONE]."""
    opts, sse = StreamOpts.of(body), Sse(request)
    opening = [mt.CHAT_OPENING] if choice is mt.chat_choice else None

    def chunk(choices: list[dict[str, Any]], done: int) -> dict[str, Any]:
        return {**mt.envelope(job, obj), "choices": choices, **opts.usage_field(job.prompt, done)}

    try:
        await sse.resp.prepare(request)  # headers now; the first token waits for TTFT
        async for i in _tokens(request, job):
            if i == 0 and opening:
                await sse.send(chunk(opening, 0))
            await sse.send(chunk([choice(mt.token_text(i), None)], i + 1))
        if job.n == 0 and opening:
            await sse.send(chunk(opening, 0))
        await sse.send(chunk([choice(None, job.finish)], job.n))
        if opts.include_usage:
            usage = mt.chat_usage(job.prompt, job.n)
            await sse.send({**mt.envelope(job, obj), "choices": [], "usage": usage})
        await sse.send("[DONE]")
    except ConnectionError:
        pass  # the engine died on purpose, or the client went away
    return sse.resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    job = _job(request, body, "chatcmpl-", mt.chat_prompt_tokens(body))
    if body.get("stream"):
        return await _stream_choices(request, job, body, "chat.completion.chunk", mt.chat_choice)
    if not await _generate(request, job):
        return web.Response()
    message = {"role": "assistant", "content": mt.generated_text(job.n), "refusal": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": job.finish}
    payload = {**mt.envelope(job, "chat.completion"), "choices": [choice]}
    return _reply(request, payload | {"usage": mt.chat_usage(job.prompt, job.n)})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    job = _job(request, body, "cmpl-", mt.completion_prompt_tokens(body))
    if body.get("stream"):
        return await _stream_choices(request, job, body, "text_completion", mt.text_choice)
    if not await _generate(request, job):
        return web.Response()
    choices = [mt.text_choice(mt.generated_text(job.n), job.finish)]
    payload = {**mt.envelope(job, "text_completion"), "choices": choices}
    return _reply(request, payload | {"usage": mt.chat_usage(job.prompt, job.n)})


async def embeddings(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    items = mt.embedding_inputs(body)
    fmt = body.get("encoding_format") or "float"
    await asyncio.sleep(_pace(request).ttft_s)
    data = [
        {"object": "embedding", "index": i, "embedding": mt.embedding(item, fmt)}
        for i, item in enumerate(items)
    ]
    prompt = sum(mt.input_tokens(item) for item in items)
    usage = {"prompt_tokens": prompt, "total_tokens": prompt}
    return _reply(request, {"object": "list", "data": data, "model": body["model"], "usage": usage})


async def responses(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    job = _job(request, body, "resp_", mt.responses_prompt_tokens(body))
    if body.get("stream"):
        return await _stream_response(request, job)
    if not await _generate(request, job):
        return web.Response()
    output = [mt.message_item(job, mt.generated_text(job.n))]
    usage = mt.responses_usage(job.prompt, job.n)
    return _reply(request, mt.response_object(job, output, usage))


async def _stream_response(request: web.Request, job: Job) -> web.StreamResponse:
    """The Responses-API event sequence that the official SDK's stream helpers expect."""
    sse, text = Sse(request), mt.generated_text(job.n)
    at = {"item_id": mt.item_id(job), "output_index": 0, "content_index": 0}
    started = mt.response_object(job, [], None)
    done = mt.message_item(job, text)
    try:
        await sse.event("response.created", response=started)
        await sse.event("response.in_progress", response=started)
        await sse.event("response.output_item.added", output_index=0, item=mt.message_item(job))
        await sse.event("response.content_part.added", **at, part=mt.text_part(""))
        async for i in _tokens(request, job):
            await sse.event("response.output_text.delta", **at, delta=mt.token_text(i), logprobs=[])
        await sse.event("response.output_text.done", **at, text=text, logprobs=[])
        await sse.event("response.content_part.done", **at, part=mt.text_part(text))
        await sse.event("response.output_item.done", output_index=0, item=done)
        usage = mt.responses_usage(job.prompt, job.n)
        await sse.event("response.completed", response=mt.response_object(job, [done], usage))
    except ConnectionError:
        pass  # the engine died on purpose, or the client went away
    return sse.resp


def _header_count(request: web.Request, name: str) -> int | None:
    value = _header_number(request, name)
    return None if value is None else int(value)


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API; the cache headers say how the prompt's usage splits."""
    body = await _body(request)
    budget = (mt.messages_budget(body), True)
    job = _job(request, body, "msg_", mt.messages_prompt_tokens(body), budget)
    read = _header_count(request, "x-mock-cache-read-tokens") or 0
    made = _header_count(request, "x-mock-cache-creation-tokens") or 0
    split = mt.prompt_split(job.prompt, read, made)
    error_after = _header_count(request, "x-mock-error-after")
    if body.get("stream"):
        return await _stream_message(request, job, split, error_after)
    if error_after is not None:
        job = dataclasses.replace(job, n=min(job.n, error_after))
    if not await _generate(request, job):
        return web.Response()
    if error_after is not None:
        return _error(request, 529, "Overloaded")
    usage = split | {"output_tokens": job.n}
    return _reply(request, mt.message_object(job, mt.generated_text(job.n), usage))


async def _stream_message(
    request: web.Request, job: Job, split: dict[str, int], error_after: int | None
) -> web.StreamResponse:
    """The Messages event sequence: start, one text block of deltas, delta with usage, stop."""
    sse = Sse(request)

    async def send(kind: str, **fields: Any) -> None:
        await sse.send({"type": kind, **fields}, event=kind)

    start = mt.message_object(job, None, split | {"output_tokens": 1})
    try:
        await send("message_start", message=start)
        await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
        await send("ping")
        async for i in _tokens(request, job):
            if i == error_after:
                break
            delta = {"type": "text_delta", "text": mt.token_text(i)}
            await send("content_block_delta", index=0, delta=delta)
        if error_after is not None:  # the engine failed after N tokens (or after them all)
            await sse.send(mt.OVERLOADED, event="error")
            return sse.resp
        await send("content_block_stop", index=0)
        stop = {"stop_reason": mt.STOP_REASONS[job.finish], "stop_sequence": None}
        await send("message_delta", delta=stop, usage={"output_tokens": job.n})
        await send("message_stop")
    except ConnectionError:
        pass  # the engine died on purpose, or the client went away
    return sse.resp


async def count_tokens(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response({"input_tokens": mt.messages_prompt_tokens(body)})


async def list_models(request: web.Request) -> web.Response:
    names = sorted({DEFAULT_MODEL, *request.app[STATS].models})
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "mock"} for n in names]
    return web.json_response({"object": "list", "data": data})


async def get_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS].snapshot())


async def reset_stats(request: web.Request) -> web.Response:
    request.app[STATS].reset()
    return web.json_response(request.app[STATS].snapshot())


def create_app(config: MockConfig) -> web.Application:
    app = web.Application(middlewares=[observe], client_max_size=64 * 1024**2)
    app[CONFIG] = config
    app[STATS] = MockStats()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/mock/stats", get_stats)
    app.router.add_post("/mock/reset", reset_stats)
    return app


async def serve(host: str, port: int, config: MockConfig) -> web.AppRunner:
    """Start serving; port 0 binds a free port (read it from `runner.addresses[0][1]`)."""
    runner = web.AppRunner(create_app(config), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Mock OpenAI-compatible engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ttft-ms", type=float, default=MockConfig.ttft_ms)
    parser.add_argument("--tokens-per-s", type=float, default=MockConfig.tokens_per_s)
    parser.add_argument("--default-max-tokens", type=int, default=MockConfig.default_max_tokens)
    args = parser.parse_args(argv)
    config = MockConfig(args.ttft_ms, args.tokens_per_s, args.default_max_tokens)
    print(f"mock engine on http://{args.host}:{args.port} {config}", flush=True)
    web.run_app(create_app(config), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
