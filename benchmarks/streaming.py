"""What the streaming benchmarks (bench_metering, bench_sources) share: the workload (chat
completions or Anthropic's Messages API), an SSE client that timestamps every event, closed
loops of clients, and a spoke serving one key that no limit could trip."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from devspoke.stack import Spoke
from gateway.policy import secrets

Api = Literal["chat", "messages"]
PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}


@dataclass(frozen=True)
class Workload:
    """A streamed request: chat completions (`chat`, Bearer key) or Anthropic's Messages API
    (`messages`, x-api-key). The same prompt and max_tokens in both shapes."""

    max_tokens: int = 64
    tokens_per_s: float = 200.0
    ttft_ms: float = 50.0
    model: str = "mock-model"
    api: Api = "chat"

    @property
    def path(self) -> str:
        return PATHS[self.api]

    def body(self) -> bytes:
        return orjson.dumps({
            "model": self.model, "stream": True, "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": "hello there, write me a story"}]})

    def headers(self, key: str) -> dict[str, str]:
        auth = ({"x-api-key": key, "anthropic-version": "2023-06-01"} if self.api == "messages"
                else {"authorization": f"Bearer {key}"})
        return {**auth, "content-type": "application/json",
                "x-mock-ttft-ms": f"{self.ttft_ms:g}",
                "x-mock-tokens-per-s": f"{self.tokens_per_s:g}"}


# --------------------------------------------------------------------------- client


@dataclass
class Sample:
    status: int = 0
    error: str = ""
    request_id: str = ""
    hdr_s: float = 0.0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    content_events: int = 0
    events: int = 0  # every SSE event, the end marker included
    reads: int = 0  # body reads (what arrived together)
    done: bool = False  # the end marker: `data: [DONE]` (chat), message_stop (messages)
    usage_chunks: int = 0  # chat only: Anthropic streams always carry usage
    api: Api = "chat"
    sent_at: float = 0.0  # wall time (time.time()) the request was sent

    def problem(self, want_tokens: int) -> str:
        if self.error:
            return self.error
        if self.status != 200:
            return f"status {self.status}"
        if self.content_events != want_tokens:
            return f"{self.content_events} content events, not {want_tokens}"
        if not self.done:
            return "no [DONE]" if self.api == "chat" else "no message_stop"
        if self.usage_chunks:
            return "a usage chunk reached the client"
        return ""


def _content(sample: Sample, now: float, t0: float, last: list[float]) -> None:
    sample.content_events += 1
    if last:
        sample.itl_s.append(now - last[0])
        last[0] = now
    else:
        sample.ttft_s = now - t0
        last.append(now)


def _event(sample: Sample, raw: bytes, now: float, t0: float, last: list[float]) -> None:
    data = b"\n".join(line[5:].lstrip(b" ") for line in raw.splitlines()
                      if line.startswith(b"data:"))
    if not data:
        return
    sample.events += 1
    if sample.api == "messages":
        # content_block_delta with text = a content event; message_stop ends the stream
        msg: dict[str, Any] = orjson.loads(data)
        kind = msg.get("type")
        if kind == "content_block_delta" and (msg.get("delta") or {}).get("text"):
            _content(sample, now, t0, last)
        elif kind == "message_stop":
            sample.done = True
        return
    if data == b"[DONE]":
        sample.done = True
        return
    obj = orjson.loads(data)
    if obj.get("usage"):
        sample.usage_chunks += 1
    for choice in obj.get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            _content(sample, now, t0, last)
            break


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes,
                      headers: dict[str, str], api: Api = "chat") -> Sample:
    sample = Sample(api=api)
    last: list[float] = []
    t0, sample.sent_at = time.perf_counter(), time.time()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            sample.hdr_s = time.perf_counter() - t0
            sample.status = resp.status
            sample.request_id = resp.headers.get("x-request-id", "")
            buf = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                sample.reads += 1
                buf += chunk
                while True:
                    end = buf.find(b"\n\n")
                    if end < 0:
                        break
                    _event(sample, buf[:end], now, t0, last)
                    buf = buf[end + 2:]
            if buf.strip():
                _event(sample, buf, time.perf_counter(), t0, last)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]
    return sample


def scenario(label: str) -> tuple[int, bool]:
    """'16' -> 16 clients starting together; '16s' -> 16 clients with staggered starts."""
    return int(label.rstrip("s")), label.endswith("s")


async def closed_loop(session: aiohttp.ClientSession, base_url: str, wl: Workload, key: str,
                      label: str, per_worker: int, deadline_s: float) -> list[Sample]:
    """`per_worker` requests from each of the scenario's clients, back to back, to
    `base_url` + the workload's API path (base_url: scheme, host and port). Staggered
    clients start spread over one request's duration, so arrivals are spread out instead of
    coming in waves of all the clients at once."""
    concurrency, stagger = scenario(label)
    body, headers, url = wl.body(), wl.headers(key), base_url + wl.path
    deadline = time.monotonic() + deadline_s
    out: list[Sample] = []
    duration_s = wl.ttft_ms / 1000 + max(0, wl.max_tokens - 1) / wl.tokens_per_s

    async def worker(i: int) -> None:
        if stagger:
            await asyncio.sleep(i * duration_s / concurrency)
        for _ in range(per_worker):
            if time.monotonic() > deadline:
                return
            out.append(await one_request(session, url, body, headers, wl.api))

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return out


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (nan for no values)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(p / 100 * len(s) + 0.999999) - 1))]


def serve_one_key(spoke: Spoke, secret: str, model: str = "mock-model",
                  limited: bool = False) -> None:
    """Publish one key, `bench`, with no limits that could trip (like the tests' `good`),
    and wait until the spoke serves it. `limited`: the model, the team and the key each
    carry limits too high to trip (rps, concurrency, tokens per minute), so every request
    is admitted through all three tiers in Redis, as a real policy's are."""
    limits = {"limits": {"rps": 1_000_000, "concurrency": 100_000,
                         "tokens_per_minute": 10_000_000_000}} if limited else {}
    spoke.publish({"models": {model: {**limits}},
                   "teams": {"bench": {"models": [model], **limits}},
                   "keys": {"bench": {"team": "bench", **limits,
                                      "sha256": secrets.digest(secret).hex()}}}, "bench")
    spoke.wait_ready()
