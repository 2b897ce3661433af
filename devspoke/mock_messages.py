"""The mock engine's Anthropic Messages API, as vLLM and SGLang serve it: /v1/messages
(streamed or not) and /v1/messages/count_tokens, with Anthropic's usage, events and errors.
x-mock-cache-read-tokens and x-mock-cache-creation-tokens say how much of the prompt the
cache served or stored; x-mock-error-after ends a stream with an `error` event after N
tokens (a plain answer becomes a 529)."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from devspoke import mock_http as mh
from devspoke import mock_tokens as mt
from devspoke.mock_tokens import Job


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API; the cache headers say how the prompt's usage splits."""
    body = await mh.read_body(request)
    budget = (mt.messages_budget(body), True)
    job = mh.new_job(request, body, "msg_", mt.messages_prompt_tokens(body), budget)
    read = mh.header_count(request, "x-mock-cache-read-tokens") or 0
    made = mh.header_count(request, "x-mock-cache-creation-tokens") or 0
    split = mt.prompt_split(job.prompt, read, made)
    error_after = mh.header_count(request, "x-mock-error-after")
    if mt.flag(body, "stream"):
        return await _stream_message(request, job, split, error_after)
    if error_after is not None:
        job = dataclasses.replace(job, n=min(job.n, error_after))
    if not await mh.generate(request, job):
        return web.Response()
    if error_after is not None:
        return mh.error(request, 529, "Overloaded")
    usage = split | {"output_tokens": job.n}
    return mh.reply(request, mt.message_object(job, mt.generated_text(job.n), usage))


async def _stream_message(
    request: web.Request, job: Job, split: dict[str, int], error_after: int | None
) -> web.StreamResponse:
    """The Messages event sequence: start, one text block of deltas, delta with usage, stop."""
    sse = mh.Sse(request)

    async def send(kind: str, **fields: Any) -> None:
        await sse.send({"type": kind, **fields}, event=kind)

    start = mt.message_object(job, None, split | {"output_tokens": 1})
    try:
        await send("message_start", message=start)
        await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
        await send("ping")
        async for i in mh.tokens(request, job):
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
    body = await mh.read_body(request)
    return web.json_response({"input_tokens": mt.messages_prompt_tokens(body)})
