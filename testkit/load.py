"""Bounded background traffic through Envoy: streams, non-streams and client cancels."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    kind: str  # 'plain' | 'stream' | 'cancel'
    status: int  # 0 = no HTTP answer (connection error)
    request_id: str = ""
    completed: bool = False  # the client read the whole response
    error: str = ""
    seconds: float = 0.0
    ended: float = 0.0  # time.monotonic() when the answer was complete


@dataclass
class Load:
    base_url: str
    key: str
    concurrency: int = 8
    max_requests: int = 2000
    max_seconds: float = 120.0
    model: str = "mock-model"
    kinds: tuple[str, ...] = ("plain", "stream", "stream", "cancel")  # drawn at random
    max_tokens: int = 12
    tokens_per_s: int = 100  # the mock engine's pace
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Result]:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(60)
        return self.results

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(15.0), limits=limits) as http:
            async def worker(seed: int) -> None:
                rnd = random.Random(seed)
                while (not self._stop.is_set() and time.monotonic() < deadline
                       and len(self.results) < self.max_requests):
                    kind = rnd.choice(self.kinds)
                    self.results.append(await self._one(http, kind))
                    await asyncio.sleep(0.01)

            await asyncio.gather(*(worker(i) for i in range(self.concurrency)))

    async def _one(self, http: httpx.AsyncClient, kind: str) -> Result:
        body = {"model": self.model, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": "tell me a story"}]}
        if kind != "plain":
            body["stream"] = True
        headers = {"authorization": f"Bearer {self.key}",
                   "x-mock-tokens-per-s": str(self.tokens_per_s)}
        r = Result(kind, 0)
        t0 = time.monotonic()
        try:
            async with http.stream("POST", f"{self.base_url}/chat/completions", json=body,
                                   headers=headers) as resp:
                r.status = resp.status_code
                r.request_id = resp.headers.get("x-request-id", "")
                n = 0
                async for _ in resp.aiter_raw():
                    n += 1
                    if kind == "cancel" and n == 3:
                        break  # the client walks away mid-stream
                else:
                    r.completed = True
        except httpx.HTTPError as exc:
            r.error = type(exc).__name__
        r.ended = time.monotonic()
        r.seconds = r.ended - t0
        return r
