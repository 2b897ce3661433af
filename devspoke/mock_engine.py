"""A mock OpenAI-compatible engine for `gateway dev` and the end-to-end tests.

It generates "tok0 tok1 ..." at a steady pace and reports honest usage (a token is a word; see
`mock_tokens`), so tests can check the gateway metered exactly what the engine reported.
Like vLLM and SGLang it also speaks Anthropic's Messages API (/v1/messages, streamed or not,
and /v1/messages/count_tokens), with Anthropic's usage, events and error shape.
Per-request headers steer it through Envoy: x-mock-ttft-ms, x-mock-tokens-per-s,
x-mock-cut-after (die after N tokens with a TCP reset), x-mock-fail-after (die after N tokens
with a plain close) and x-mock-status (answer that status with an OpenAI-shaped error, or an
Anthropic-shaped one on /v1/messages*; a 204 or 304 with no body, and any status with no
body with x-mock-empty; before reading the request's body with x-mock-early). POST
/tokenize is vLLM's
(the token count of `prompt`, a word a token), steered by x-mock-status too. On
/v1/messages only: x-mock-cache-read-tokens and x-mock-cache-creation-tokens (how much of
the prompt the cache served or stored) and x-mock-error-after (after N tokens a stream
ends with an `error` event, a plain answer is 529).
x-mock-compress: compress answers the request accepts compressed (Accept-Encoding).
GET /mock/stats reports what the engine saw; POST /mock/reset zeroes it.

This module: the OpenAI endpoints, the app and its command line. The request plumbing both
APIs share is in `mock_http`, the Messages API in `mock_messages`, the pure token and usage
logic in `mock_tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from devspoke import mock_http as mh
from devspoke import mock_messages
from devspoke import mock_tokens as mt
from devspoke.mock_http import MockConfig, observe
from devspoke.mock_tokens import Job, MockStats, StreamOpts

DEFAULT_MODEL = "mock-model"


ChoiceFn = Callable[[str | None, str | None], dict[str, Any]]


async def _stream_choices(
    request: web.Request, job: Job, body: dict[str, Any], obj: str, choice: ChoiceFn
) -> web.StreamResponse:
    """Shared SSE loop of chat and legacy completions: tokens, finish, usage, [DONE]."""
    opts, sse = StreamOpts.of(body), mh.Sse(request)
    opening = [mt.CHAT_OPENING] if choice is mt.chat_choice else None

    def chunk(choices: list[dict[str, Any]], done: int) -> dict[str, Any]:
        return {**mt.envelope(job, obj), "choices": choices, **opts.usage_field(job.prompt, done)}

    try:
        await sse.resp.prepare(request)  # headers now; the first token waits for TTFT
        async for i in mh.tokens(request, job):
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
    body = await mh.read_body(request)
    job = mh.new_job(request, body, "chatcmpl-", mt.chat_prompt_tokens(body))
    if mt.flag(body, "stream"):
        return await _stream_choices(request, job, body, "chat.completion.chunk", mt.chat_choice)
    if not await mh.generate(request, job):
        return web.Response()
    message = {"role": "assistant", "content": mt.generated_text(job.n), "refusal": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": job.finish}
    payload = {**mt.envelope(job, "chat.completion"), "choices": [choice]}
    return mh.reply(request, payload | {"usage": mt.chat_usage(job.prompt, job.n)})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await mh.read_body(request)
    job = mh.new_job(request, body, "cmpl-", mt.completion_prompt_tokens(body))
    if mt.flag(body, "stream"):
        return await _stream_choices(request, job, body, "text_completion", mt.text_choice)
    if not await mh.generate(request, job):
        return web.Response()
    choices = [mt.text_choice(mt.generated_text(job.n), job.finish)]
    payload = {**mt.envelope(job, "text_completion"), "choices": choices}
    return mh.reply(request, payload | {"usage": mt.chat_usage(job.prompt, job.n)})


async def embeddings(request: web.Request) -> web.StreamResponse:
    body = await mh.read_body(request)
    items = mt.embedding_inputs(body)
    fmt = body.get("encoding_format") or "float"
    await asyncio.sleep(mh.pace(request).ttft_s)
    data = [
        {"object": "embedding", "index": i, "embedding": mt.embedding(item, fmt)}
        for i, item in enumerate(items)
    ]
    prompt = sum(mt.input_tokens(item) for item in items)
    usage = {"prompt_tokens": prompt, "total_tokens": prompt}
    payload = {"object": "list", "data": data, "model": body["model"], "usage": usage}
    return mh.reply(request, payload)


async def responses(request: web.Request) -> web.StreamResponse:
    body = await mh.read_body(request)
    job = mh.new_job(request, body, "resp_", mt.responses_prompt_tokens(body))
    if mt.flag(body, "stream"):
        return await _stream_response(request, job)
    if not await mh.generate(request, job):
        return web.Response()
    output = [mt.message_item(job, mt.generated_text(job.n))]
    usage = mt.responses_usage(job.prompt, job.n)
    return mh.reply(request, mt.response_object(job, output, usage))


async def _stream_response(request: web.Request, job: Job) -> web.StreamResponse:
    """The Responses-API event sequence that the official SDK's stream helpers expect."""
    sse, text = mh.Sse(request), mt.generated_text(job.n)
    at = {"item_id": mt.item_id(job), "output_index": 0, "content_index": 0}
    started = mt.response_object(job, [], None)
    done = mt.message_item(job, text)
    try:
        await sse.event("response.created", response=started)
        await sse.event("response.in_progress", response=started)
        await sse.event("response.output_item.added", output_index=0, item=mt.message_item(job))
        await sse.event("response.content_part.added", **at, part=mt.text_part(""))
        async for i in mh.tokens(request, job):
            await sse.event("response.output_text.delta", **at, delta=mt.token_text(i), logprobs=[])
        await sse.event("response.output_text.done", **at, text=text, logprobs=[])
        await sse.event("response.content_part.done", **at, part=mt.text_part(text))
        await sse.event("response.output_item.done", output_index=0, item=done)
        usage = mt.responses_usage(job.prompt, job.n)
        await sse.event("response.completed", response=mt.response_object(job, [done], usage))
    except ConnectionError:
        pass  # the engine died on purpose, or the client went away
    return sse.resp


async def list_models(request: web.Request) -> web.Response:
    names = sorted({DEFAULT_MODEL, *request.app[mh.STATS].models})
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "mock"} for n in names]
    return web.json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize (not under /v1): the prompt's tokens, a word a token."""
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        body = None
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, str):
        return mh.error(request, 400, "prompt must be a string")
    n = mt.words(prompt)
    return web.json_response({"count": n, "max_model_len": 4096, "tokens": list(range(n))})


async def get_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[mh.STATS].snapshot())


async def reset_stats(request: web.Request) -> web.Response:
    request.app[mh.STATS].reset()
    return web.json_response(request.app[mh.STATS].snapshot())


def create_app(config: MockConfig) -> web.Application:
    app = web.Application(middlewares=[observe], client_max_size=64 * 1024**2)
    app[mh.CONFIG] = config
    app[mh.STATS] = MockStats()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", mock_messages.messages)
    app.router.add_post("/v1/messages/count_tokens", mock_messages.count_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
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
