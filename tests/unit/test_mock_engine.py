"""The mock engine speaks the OpenAI wire format and reports honest, deterministic usage.

The end-to-end tests trust its numbers and its fault injection, so both are pinned here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from devspoke.mock_engine import MockConfig, main, serve

CHAT = "/v1/chat/completions"
Event = tuple[str | None, str]  # (event name, data)


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    runner = await serve("127.0.0.1", 0, MockConfig(ttft_ms=0, tokens_per_s=0))
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base_url, timeout=10, trust_env=False) as c:
        yield c


async def sse(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[list[Event], bool]:
    """POST and read the event stream; also say whether the body ended cleanly."""
    events: list[Event] = []
    name: str | None = None
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert "content-length" not in resp.headers
            async for line in resp.aiter_lines():
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    events.append((name, line.removeprefix("data: ")))
                    name = None
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return events, False
    return events, True


def chunks(events: list[Event]) -> list[dict[str, Any]]:
    return [json.loads(data) for _, data in events if data != "[DONE]"]


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/mock/stats")
    return resp.json()


async def settled(client: httpx.AsyncClient) -> dict[str, Any]:
    """Stats once the engine has finished with every request (a cut lands asynchronously)."""
    for _ in range(100):
        current = await stats(client)
        if current["in_flight"] == 0:
            return current
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests still in flight: {current}")


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "three word prompt"}]},
]  # 5 words


async def test_chat_completion_reports_word_counts(client: httpx.AsyncClient) -> None:
    resp = await client.post(CHAT, json={"model": "m", "messages": MESSAGES, "max_tokens": 4})
    body = resp.json()
    assert resp.status_code == 200
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "tok0 tok1 tok2 tok3",
        "refusal": None,
    }
    assert choice["finish_reason"] == "length"
    assert body["usage"] == usage(5, 4)


async def test_default_budget_stops_naturally(client: httpx.AsyncClient) -> None:
    resp = await client.post(CHAT, json={"model": "m", "messages": []})
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == 1  # never zero
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_max_completion_tokens_wins(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 2}
    resp = await client.post(CHAT, json=body)
    assert resp.json()["usage"]["completion_tokens"] == 2


async def test_text_completion(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "prompt": ["one two", "three"], "max_tokens": 3}
    resp = await client.post("/v1/completions", json=body)
    out = resp.json()
    assert out["object"] == "text_completion"
    assert out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == "tok0 tok1 tok2"
    assert out["usage"] == usage(3, 3)


async def test_embeddings_accept_a_string_or_a_list(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/embeddings", json={"model": "e", "input": ["a b", "c d e"]})
    out = resp.json()
    assert out["object"] == "list"
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 8 for d in out["data"])
    assert out["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    single = (await client.post("/v1/embeddings", json={"model": "e", "input": "a b"})).json()
    assert single["data"][0]["embedding"] == out["data"][0]["embedding"]  # deterministic
    assert single["usage"]["prompt_tokens"] == 2


async def test_responses_non_stream(client: httpx.AsyncClient) -> None:
    body = {
        "model": "m",
        "instructions": "be kind",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi there"}]}],
        "max_output_tokens": 3,
    }
    out = (await client.post("/v1/responses", json=body)).json()
    assert out["id"].startswith("resp_")
    assert (out["object"], out["status"]) == ("response", "completed")
    message = out["output"][0]
    assert (message["type"], message["role"]) == ("message", "assistant")
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == "tok0 tok1 tok2"
    assert out["usage"] == {
        "input_tokens": 4,
        "output_tokens": 3,
        "total_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


async def test_chat_stream_without_usage_has_no_usage_keys(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "stream": True}
    events, clean = await sse(client, CHAT, body)
    assert clean
    assert events[-1] == (None, "[DONE]")
    parsed = chunks(events)
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in parsed)
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in parsed)
    assert text == "tok0 tok1 tok2"
    assert parsed[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert len(parsed) == 5  # role, 3 tokens, finish
    assert (await settled(client))["usage_reported"] == {"prompt_tokens": 0, "completion_tokens": 0}


async def test_chat_stream_include_usage(client: httpx.AsyncClient) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events, clean = await sse(client, CHAT, body)
    assert clean and events[-1][1] == "[DONE]"
    *streamed, last = chunks(events)
    assert all(c["usage"] is None and c["choices"] for c in streamed)
    assert last["choices"] == []
    assert last["usage"] == usage(5, 3)
    reported = (await settled(client))["usage_reported"]
    assert reported == {"prompt_tokens": 5, "completion_tokens": 3}


async def test_continuous_usage_stats_carry_running_counts(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    events, _ = await sse(client, CHAT, body | {"stream_options": options})
    running = [c["usage"]["completion_tokens"] for c in chunks(events)]
    assert running == [0, 1, 2, 2, 2]  # role, tok0, tok1, finish, final usage chunk
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks(events))
    # Like vLLM, continuous stats are only honoured together with include_usage.
    events, _ = await sse(client, CHAT, body | {"stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks(events))


async def test_completions_stream_include_usage(client: httpx.AsyncClient) -> None:
    body = {
        "model": "m",
        "prompt": "a b c",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events, clean = await sse(client, "/v1/completions", body)
    parsed = chunks(events)
    assert clean and events[-1][1] == "[DONE]"
    assert all(c["object"] == "text_completion" for c in parsed)
    assert "".join(c["choices"][0]["text"] for c in parsed[:-1]) == "tok0 tok1"
    assert parsed[-2]["choices"][0]["finish_reason"] == "length"
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"] == usage(3, 2)


@pytest.mark.parametrize("header", ["x-mock-cut-after", "x-mock-fail-after"])
async def test_dying_engine_truncates_the_stream(client: httpx.AsyncClient, header: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 10, "stream": True}
    events, clean = await sse(client, CHAT, body | {"stream_options": options}, {header: "3"})
    assert not clean
    assert (None, "[DONE]") not in events
    parsed = chunks(events)
    assert [c["choices"][0]["delta"].get("content") for c in parsed[1:]] == [
        "tok0",
        " tok1",
        " tok2",
    ]
    assert all(c["choices"][0]["finish_reason"] is None for c in parsed)
    after = await settled(client)
    assert after["usage_reported"] == {"prompt_tokens": 5, "completion_tokens": 3}


async def test_cut_after_the_last_token_still_withholds_the_end(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    events, clean = await sse(client, CHAT, body, {"x-mock-cut-after": "5"})
    assert not clean
    assert len(chunks(events)) == 3  # role + 2 tokens, no finish chunk
    assert (await settled(client))["in_flight"] == 0


async def test_cut_non_stream_gets_no_response(client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.TransportError):
        await client.post(CHAT, json={"model": "m"}, headers={"x-mock-cut-after": "1"})
    after = await settled(client)
    assert after["usage_reported"] == {"prompt_tokens": 0, "completion_tokens": 0}


async def test_forced_status(client: httpx.AsyncClient) -> None:
    resp = await client.post(CHAT, json={"model": "m"}, headers={"x-mock-status": "503"})
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["type"] == "server_error"
    assert error["code"] is None
    assert isinstance(error["message"], str)


@pytest.mark.parametrize("status", [204, 304])
async def test_a_forced_status_with_no_body_has_none(client: httpx.AsyncClient,
                                                     status: int) -> None:
    resp = await client.post(CHAT, json={"model": "m"}, headers={"x-mock-status": str(status)})
    assert (resp.status_code, resp.content) == (status, b"")


@pytest.mark.parametrize("empty", [True, False])
async def test_x_mock_early_answers_before_the_body_came(base_url: str, empty: bool) -> None:
    """x-mock-early: the forced status is answered from the headers alone, while the body
    (1 MB announced, a few bytes sent) is still on its way; empty or with its JSON."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n"
                 f"x-mock-status: 413\r\nx-mock-early: 1\r\n"
                 f"{'x-mock-empty: 1' if empty else 'x-mock-none: 1'}\r\n\r\n{{".encode())
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 413 ")
    lengths = [line.split(b":", 1)[1].strip() for line in head.lower().split(b"\r\n")
               if line.startswith(b"content-length:")]
    assert (lengths == [b"0"]) == empty


@pytest.mark.parametrize("status", [200, 404, 500])
async def test_x_mock_empty_gives_any_status_no_body(client: httpx.AsyncClient,
                                                     status: int) -> None:
    resp = await client.post(CHAT, json={"model": "m"},
                             headers={"x-mock-status": str(status), "x-mock-empty": "1"})
    assert (resp.status_code, resp.content) == (status, b"")
    assert resp.headers["content-length"] == "0"


async def test_tokenize_counts_words_and_takes_a_forced_status(
        client: httpx.AsyncClient) -> None:
    """vLLM's /tokenize (testkit's policy lets it through as a pass-through path)."""
    resp = await client.post("/tokenize", json={"prompt": "a b c"})
    assert resp.json() == {"count": 3, "max_model_len": 4096, "tokens": [0, 1, 2]}
    assert (await client.post("/tokenize", content=b"")).status_code == 400
    forced = await client.post("/tokenize", content=b"", headers={"x-mock-status": "204"})
    assert (forced.status_code, forced.content) == (204, b"")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(b"{not json", "invalid JSON"), (b'{"messages": []}', "model"), (b"[1]", "object")],
)
async def test_bad_bodies_are_400(client: httpx.AsyncClient, content: bytes, fragment: str) -> None:
    resp = await client.post(CHAT, content=content)
    assert resp.status_code == 400
    assert fragment in resp.json()["error"]["message"]
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "fields"), [
    (CHAT, {"messages": MESSAGES}), ("/v1/completions", {"prompt": "a b"}),
    ("/v1/responses", {"input": "a b"}), ("/v1/messages", {"messages": MESSAGES})])
async def test_stream_is_read_as_vllm_reads_it(client: httpx.AsyncClient, path: str,
                                               fields: dict[str, Any]) -> None:
    """pydantic's lax bool: "true", 1, "yes" stream; "false", 0, null do not; "maybe" is
    a 400 (vLLM's `stream: bool | None`). Python's truthiness would stream "false"."""
    body = {"model": "m", "max_tokens": 2, **fields}
    for value in ("true", "TRUE", 1, 1.0, "yes", "on", "t", "1"):
        r = await client.post(path, json=body | {"stream": value})
        assert r.headers["content-type"].startswith("text/event-stream"), value
    for value in ("false", "0", 0, 0.0, "no", "off", "F", None):
        r = await client.post(path, json=body | {"stream": value})
        assert r.headers["content-type"].startswith("application/json"), value
    for value in ("maybe", 2, " true", [], {}):
        r = await client.post(path, json=body | {"stream": value})
        assert r.status_code == 400, value


async def test_include_usage_is_read_as_vllm_reads_it(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, "stream": "true"}
    events, _ = await sse(client, CHAT, body | {"stream_options": {"include_usage": "yes"}})
    assert chunks(events)[-1]["usage"] == usage(5, 2)
    events, _ = await sse(client, CHAT, body | {"stream_options": {"include_usage": "false"}})
    assert all("usage" not in c for c in chunks(events))
    bad = {"stream_options": {"include_usage": "maybe"}}
    assert (await client.post(CHAT, json=body | bad)).status_code == 400


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "frobnicate": {"x": 1}}
    assert (await client.post(CHAT, json=body)).status_code == 200


async def test_responses_stream_events(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "input": "hello world", "max_output_tokens": 3, "stream": True}
    events, clean = await sse(client, "/v1/responses", body)
    assert clean
    names = [name for name, _ in events]
    assert names[0] == "response.created"
    assert names[-1] == "response.completed"
    assert names.count("response.output_text.delta") == 3
    assert "[DONE]" not in [data for _, data in events]
    parsed = chunks(events)
    assert [p["type"] for p in parsed] == names
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    deltas = [p["delta"] for p in parsed if p["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "tok0 tok1 tok2"
    final = parsed[-1]["response"]
    assert final["status"] == "completed"
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == (2, 3)
    assert parsed[0]["response"]["usage"] is None


async def test_ttft_and_pace_headers(client: httpx.AsyncClient) -> None:
    headers = {"x-mock-ttft-ms": "150", "x-mock-tokens-per-s": "50"}
    start = time.monotonic()
    await client.post(CHAT, json={"model": "m", "max_tokens": 3}, headers=headers)
    assert time.monotonic() - start >= 0.15 + 2 / 50 - 0.01
    bad = await client.post(CHAT, json={"model": "m"}, headers={"x-mock-ttft-ms": "soon"})
    assert bad.status_code == 400


async def test_stats_track_concurrency_headers_and_reset(client: httpx.AsyncClient) -> None:
    slow = {"x-mock-ttft-ms": "200", "X-Trace": "abc"}
    body = {"model": "m", "max_tokens": 1}
    await asyncio.gather(*(client.post(CHAT, json=body, headers=slow) for _ in range(3)))
    seen = await settled(client)
    assert (seen["requests"], seen["max_in_flight"]) == (3, 3)
    assert seen["usage_reported"] == {"prompt_tokens": 3, "completion_tokens": 3}
    assert all(h["x-trace"] == "abc" for h in seen["last_headers"])
    assert all(name == name.lower() for h in seen["last_headers"] for name in h)
    await client.post("/mock/reset")
    assert await stats(client) == {
        "in_flight": 0,
        "max_in_flight": 0,
        "requests": 0,
        "usage_reported": {"prompt_tokens": 0, "completion_tokens": 0},
        "messages_usage_reported": ANTHROPIC_ZERO,
        "last_headers": [],
    }


async def test_header_history_is_bounded(client: httpx.AsyncClient) -> None:
    for i in range(55):
        await client.get("/v1/models", headers={"x-n": str(i)})
    history = (await stats(client))["last_headers"]
    assert [h["x-n"] for h in history] == [str(i) for i in range(5, 55)]


async def test_abandoned_stream_leaves_flight(client: httpx.AsyncClient) -> None:
    body = {"model": "m", "max_tokens": 1000, "stream": True}
    async with client.stream("POST", CHAT, json=body, headers={"x-mock-tokens-per-s": "100"}) as r:
        async for _ in r.aiter_lines():
            break
    assert (await settled(client))["in_flight"] == 0


async def test_models_lists_seen_names(client: httpx.AsyncClient) -> None:
    await client.post(CHAT, json={"model": "llama", "max_tokens": 1})
    out = (await client.get("/v1/models")).json()
    assert out["object"] == "list"
    assert {m["id"] for m in out["data"]} == {"llama", "mock-model"}
    assert all(m["object"] == "model" for m in out["data"])


async def test_openai_sdk_consumes_the_streams(base_url: str, client: httpx.AsyncClient) -> None:
    sdk = AsyncOpenAI(api_key="sk-test", base_url=f"{base_url}/v1", max_retries=0)
    stream = await sdk.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "one two three"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, last_usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        last_usage = chunk.usage or last_usage
    assert text == "tok0 tok1 tok2 tok3"
    assert last_usage is not None
    assert (last_usage.prompt_tokens, last_usage.completion_tokens) == (3, 4)

    vectors = await sdk.embeddings.create(model="e", input=["a b", "c"])
    assert [len(d.embedding) for d in vectors.data] == [8, 8]
    assert vectors.usage.prompt_tokens == 3

    events = await sdk.responses.create(model="m", input="hi", max_output_tokens=2, stream=True)
    kinds = [event.type async for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    headers = (await stats(client))["last_headers"]
    assert headers[0]["authorization"] == "Bearer sk-test"
    await sdk.close()


MSGS = "/v1/messages"
ANTHROPIC = {
    "model": "claude-m",
    "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "one two three"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": [{"type": "text", "text": "go on"}]},
    ],
    "max_tokens": 3,
    "metadata": {"user_id": "u"},  # unknown to the mock: ignored
}  # 8 words
ANTHROPIC_ZERO = {
    "input_tokens": 0,
    "output_tokens": 0,
    "cache_read_input_tokens": 0,
    "cache_creation_input_tokens": 0,
}


@pytest.mark.parametrize(
    ("read", "made", "split"),
    [(None, None, (8, 0, 0)), ("3", "2", (3, 2, 3)), ("6", "9", (0, 2, 6)), ("99", "1", (0, 0, 8))],
)
async def test_messages_usage_splits_the_prompt_by_cache(
    client: httpx.AsyncClient, read: str | None, made: str | None, split: tuple[int, int, int]
) -> None:
    headers = {"x-mock-cache-read-tokens": read, "x-mock-cache-creation-tokens": made}
    headers = {k: v for k, v in headers.items() if v is not None}
    resp = await client.post(MSGS, json=ANTHROPIC, headers=headers)
    out = resp.json()
    assert resp.status_code == 200
    assert out["id"].startswith("msg_") and len(out["id"]) > len("msg_")
    assert {k: out[k] for k in ("type", "role", "model", "stop_sequence")} == {
        "type": "message",
        "role": "assistant",
        "model": "claude-m",
        "stop_sequence": None,
    }
    assert out["content"] == [{"type": "text", "text": "tok0 tok1 tok2"}]
    assert out["stop_reason"] == "max_tokens"
    usage = {
        "input_tokens": split[0],
        "cache_creation_input_tokens": split[1],
        "cache_read_input_tokens": split[2],
        "output_tokens": 3,
    }
    assert out["usage"] == usage
    seen = await settled(client)
    assert seen["usage_reported"] == {"prompt_tokens": 8, "completion_tokens": 3}
    assert seen["messages_usage_reported"] == usage


async def test_messages_stream_events(client: httpx.AsyncClient) -> None:
    headers = {"x-mock-cache-read-tokens": "5"}
    events, clean = await sse(client, MSGS, ANTHROPIC | {"stream": True}, headers)
    assert clean
    parsed = chunks(events)
    names = [name for name, _ in events]
    assert [p["type"] for p in parsed] == names
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    message = parsed[0]["message"]
    assert (message["content"], message["stop_reason"], message["model"]) == ([], None, "claude-m")
    assert message["usage"] == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 5,
        "output_tokens": 1,
    }
    assert parsed[1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [p for p in parsed if p["type"] == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == "tok0 tok1 tok2"
    assert parsed[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"output_tokens": len(deltas)},
    }
    assert parsed[-1] == {"type": "message_stop"}
    seen = await settled(client)
    assert seen["usage_reported"] == {"prompt_tokens": 8, "completion_tokens": 3}
    assert seen["messages_usage_reported"] == message["usage"] | {"output_tokens": 3}


@pytest.mark.parametrize("after", [0, 2, 3])
async def test_messages_error_after_ends_the_stream_cleanly(
    client: httpx.AsyncClient, after: int
) -> None:
    body = ANTHROPIC | {"stream": True}
    events, clean = await sse(client, MSGS, body, {"x-mock-error-after": str(after)})
    assert clean
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", "ping"] + [
        "content_block_delta"
    ] * after + ["error"]
    assert json.loads(events[-1][1]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    # the client was only ever told message_start's usage
    assert (await settled(client))["messages_usage_reported"]["output_tokens"] == 1
    plain = await client.post(MSGS, json=ANTHROPIC, headers={"x-mock-error-after": "1"})
    assert plain.status_code == 529
    assert plain.json()["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("max_tokens", [None, 0, -1, "3", True, 1.5])
async def test_messages_need_max_tokens(client: httpx.AsyncClient, max_tokens: Any) -> None:
    body = {k: v for k, v in ANTHROPIC.items() if k != "max_tokens"}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    resp = await client.post(MSGS, json=body)
    assert resp.status_code == 400
    out = resp.json()
    assert out["type"] == "error"
    assert out["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in out["error"]["message"]
    assert (await settled(client))["messages_usage_reported"] == ANTHROPIC_ZERO


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (402, "billing_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "api_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
async def test_messages_forced_status_is_anthropic_shaped(
    client: httpx.AsyncClient, status: int, kind: str
) -> None:
    for path in (MSGS, MSGS + "/count_tokens"):
        resp = await client.post(path, json=ANTHROPIC, headers={"x-mock-status": str(status)})
        assert resp.status_code == status
        assert resp.json() == {
            "type": "error",
            "error": {"type": kind, "message": f"mock engine failure (x-mock-status: {status})"},
        }


async def test_count_tokens(client: httpx.AsyncClient) -> None:
    resp = await client.post(MSGS + "/count_tokens", json=ANTHROPIC)
    assert resp.json() == {"input_tokens": 8}
    plain = {"model": "m", "system": "a b c", "messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post(MSGS + "/count_tokens", json=plain)).json() == {"input_tokens": 4}
    bad = await client.post(MSGS + "/count_tokens", json={"model": "m"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    seen = await settled(client)
    assert seen["requests"] == 3
    assert seen["usage_reported"] == {"prompt_tokens": 0, "completion_tokens": 0}  # no generation


def test_base64_embeddings_decode_to_the_float_vector() -> None:
    from devspoke.mock_tokens import embedding

    packed = embedding("a b", "base64")
    floats = embedding("a b", "float")
    assert isinstance(packed, str) and isinstance(floats, list)
    decoded = struct.unpack("<8f", base64.b64decode(packed))
    assert decoded == pytest.approx(floats, abs=1e-6)


def test_main_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["--port", "not-a-port"])
