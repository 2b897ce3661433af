"""A tiny OpenAI-shaped engine on Starlette + uvicorn, the stack vLLM and SGLang serve on.

The side-door tests put it behind the real Envoy so that the engine's own path handling
(uvicorn percent-decodes the path, Starlette routes on the decoded form and redirects a
trailing slash) is what the gateway must match, not the aiohttp mock's. It records every
request it sees: `GET /__seen` returns them and forgets them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

SEEN: list[dict[str, Any]] = []


class Record:
    """Every request, whatever route it matches (or none), as the engine understood it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/__seen":
            SEEN.append({"method": scope["method"], "path": scope["path"],
                         "raw_path": scope.get("raw_path", b"").decode("latin-1"),
                         "headers": [[k.decode("latin-1"), v.decode("latin-1")]
                                     for k, v in scope["headers"]]})
        await self.app(scope, receive, send)


async def _model(request: Request) -> str:
    body = json.loads(await request.body() or b"{}")
    model = body.get("model") if isinstance(body, dict) else None
    SEEN[-1]["model"] = model
    return str(model)


async def chat(request: Request) -> JSONResponse:
    model = await _model(request)
    return JSONResponse({
        "id": "chatcmpl-asgi", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


async def completions(request: Request) -> JSONResponse:
    model = await _model(request)
    return JSONResponse({
        "id": "cmpl-asgi", "object": "text_completion", "created": 0, "model": model,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


async def tokenize(request: Request) -> JSONResponse:
    await _model(request)
    return JSONResponse({"tokens": [1, 2, 3], "count": 3})


async def anything(request: Request) -> JSONResponse:
    """An engine-specific endpoint the gateway does not know (vLLM has many)."""
    await _model(request)
    return JSONResponse({"served": request.url.path})


async def seen(request: Request) -> JSONResponse:
    out = list(SEEN)
    SEEN.clear()
    return JSONResponse(out)


def create_app() -> ASGIApp:
    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", completions, methods=["POST"]),
        Route("/v1/responses", chat, methods=["POST"]),
        Route("/v1/messages", chat, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/secret/{rest:path}", anything, methods=["GET", "POST"]),
        Route("/__seen", seen, methods=["GET"]),
    ]
    return Record(Starlette(routes=routes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    print(f"asgi engine on 127.0.0.1:{args.port}", flush=True)
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
