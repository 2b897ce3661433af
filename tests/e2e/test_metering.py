"""Exactly one usage event per request, through real Envoy + Tansu + Redis, openai SDK."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import openai
import pytest

from devspoke.stack import Spoke
from testkit.spoke import client, read_events

MSG = [{"role": "user", "content": "count these five words"}]
ALSO_GRPC_CHECK = True  # the Envoy source behind either of the Check's doors (conftest)


def _rid(raw: Any) -> str:
    return str(raw.headers["x-request-id"])


def _drain(stream: Any) -> list[Any]:
    return list(stream)


def test_mixed_requests_yield_exactly_one_event_each(spoke: Spoke, keys: dict[str, str]) -> None:
    c = client(spoke, keys["good"])
    rids: dict[str, str] = {}
    chat = c.chat.completions.with_raw_response
    comp = c.completions.with_raw_response
    r = chat.create(model="mock-model", messages=MSG, max_tokens=5)
    rids["chat"] = _rid(r)
    r = chat.create(model="mock-model", messages=MSG, max_tokens=6, stream=True)
    _drain(r.parse())
    rids["chat-stream"] = _rid(r)
    r = chat.create(model="mock-model", messages=MSG, max_tokens=7, stream=True,
                    stream_options={"include_usage": True})
    _drain(r.parse())
    rids["chat-stream-usage"] = _rid(r)
    r = comp.create(model="mock-model", prompt="one two three", max_tokens=4)
    rids["completion"] = _rid(r)
    r = comp.create(model="mock-model", prompt="one two three", max_tokens=3, stream=True)
    _drain(r.parse())
    rids["completion-stream"] = _rid(r)
    r = c.embeddings.with_raw_response.create(model="mock-model", input=["a b", "c d e"])
    rids["embeddings"] = _rid(r)
    r = c.responses.with_raw_response.create(model="mock-model", input="hi there",
                                             max_output_tokens=5)
    rids["responses"] = _rid(r)
    r = c.responses.with_raw_response.create(model="mock-model", input="hi there you",
                                             max_output_tokens=4, stream=True)
    _drain(r.parse())
    rids["responses-stream"] = _rid(r)
    r = chat.create(model="mock-other", messages=MSG, max_tokens=3, stream=True)  # continuous
    _drain(r.parse())
    rids["chat-continuous"] = _rid(r)

    events = read_events(spoke.kafka_bootstrap, set(rids.values()))
    by_id = {e["event_id"]: e for e in events}
    assert len(events) == len(rids) == len(by_id), "exactly one event per request"
    engine = httpx.get(f"{spoke.engine_url}/mock/stats").json()["usage_reported"]
    assert sum(int(e["usage"]["prompt_tokens"]) for e in events) == engine["prompt_tokens"]
    assert sum(int(e["usage"]["completion_tokens"]) for e in events) == \
        engine["completion_tokens"]
    for name, rid in rids.items():
        e = by_id[rid]
        assert e["outcome"] == "completed", name
        assert e["usage_source"] == "reported", name
        assert e["key_id"] == "good" and e["team"] == "t1", name
        assert e["status_code"] == 200
        assert e["served_model"] in ("mock-model", "mock-other"), name
    assert by_id[rids["chat-stream"]]["usage"]["completion_tokens"] == "6"
    assert by_id[rids["embeddings"]]["endpoint"] == "/v1/embeddings"
    assert by_id[rids["responses-stream"]]["usage"]["completion_tokens"] == "4"
    assert float(by_id[rids["chat-stream"]]["timing"]["ttft_ms"]) > 0
    seqs = sorted(int(e["seq"]) for e in events)
    assert len(set(seqs)) == len(seqs)


def test_usage_chunk_only_for_clients_that_asked(spoke: Spoke, keys: dict[str, str]) -> None:
    c = client(spoke, keys["good"])
    plain = list(c.chat.completions.create(model="mock-model", messages=MSG, max_tokens=3,
                                           stream=True))
    assert all(ch.usage is None and ch.choices for ch in plain)
    raw = httpx.post(f"{spoke.base_url}/chat/completions",
                     headers={"authorization": f"Bearer {keys['good']}"},
                     json={"model": "mock-model", "messages": MSG, "max_tokens": 3,
                           "stream": True})
    assert b'"usage"' not in raw.content  # not even the `"usage": null` OpenAI would add
    assert raw.content.rstrip().endswith(b"data: [DONE]")
    asked = list(c.chat.completions.create(model="mock-model", messages=MSG, max_tokens=3,
                                           stream=True, stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 3
    # continuous usage injected for mock-other is hidden from a client that asked only for
    # the final usage chunk
    cont = list(c.chat.completions.create(model="mock-other", messages=MSG, max_tokens=3,
                                          stream=True, stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in cont[:-1]) and cont[-1].usage.total_tokens > 0


def test_a_stream_flag_vllm_reads_as_true_is_metered_as_a_stream(
        spoke: Spoke, keys: dict[str, str]) -> None:
    """`"stream": "true"` (or 1, "Yes"...) streams on vLLM and SGLang (pydantic's lax bool;
    the mock engine reads it with pydantic too), so the gateway asks for the usage chunk,
    hides it from a client that did not ask, and bills the engine's count: exactly as for
    `"stream": true`. One the engine refuses ("maybe") is its 400, passed through."""
    auth = {"authorization": f"Bearer {keys['good']}"}
    sent: dict[str, tuple[Any, int]] = {}  # request id: (its stream value, its max_tokens)
    for i, value in enumerate([True, "true", 1, "Yes", 1.0, "on"]):
        for path, field in (("chat/completions", {"messages": MSG}),
                            ("completions", {"prompt": "one two three"})):
            r = httpx.post(f"{spoke.base_url}/{path}", headers=auth,
                           json={"model": "mock-model", **field, "max_tokens": 3 + i % 3,
                                 "stream": value})
            sent[r.headers["x-request-id"]] = (value, 3 + i % 3)
            assert r.status_code == 200, (path, value, r.text)
            assert r.headers["content-type"].startswith("text/event-stream"), (path, value)
            assert b'"usage"' not in r.content, (path, value)  # the injected chunk: hidden
            assert r.content.rstrip().endswith(b"data: [DONE]")
    for path, field in (("responses", {"input": "hi there", "max_output_tokens": 5}),
                        ("messages", {"messages": MSG, "max_tokens": 5})):  # usage native
        r = httpx.post(f"{spoke.base_url}/{path}", headers=auth,
                       json={"model": "mock-model", **field, "stream": "True"})
        assert r.headers["content-type"].startswith("text/event-stream"), (path, r.text)
        sent[r.headers["x-request-id"]] = ("True", 5)
    plain = httpx.post(f"{spoke.base_url}/chat/completions", headers=auth,
                       json={"model": "mock-model", "messages": MSG, "max_tokens": 4,
                             "stream": "false"})
    assert plain.headers["content-type"].startswith("application/json")
    refused = httpx.post(f"{spoke.base_url}/chat/completions", headers=auth,
                         json={"model": "mock-model", "messages": MSG, "max_tokens": 4,
                               "stream": "maybe"})
    assert refused.status_code == 400, refused.text  # the engine's own answer
    others = {plain.headers["x-request-id"]: plain, refused.headers["x-request-id"]: refused}
    events = read_events(spoke.kafka_bootstrap, {*sent, *others})
    by_id = {e["event_id"]: e for e in events}
    assert len(events) == len(by_id) == len(sent) + 2, "exactly one event per request"
    engine = httpx.get(f"{spoke.engine_url}/mock/stats").json()["usage_reported"]
    assert sum(int(e["usage"]["completion_tokens"]) for e in events) == \
        engine["completion_tokens"]
    for rid, (value, max_tokens) in sent.items():
        e = by_id[rid]
        assert (e["stream"], e["outcome"], e["usage_source"]) == \
            (True, "completed", "reported"), value
        assert e["usage"]["completion_tokens"] == str(max_tokens), value
    p = by_id[plain.headers["x-request-id"]]
    assert (p["stream"], p["usage_source"], p["usage"]["completion_tokens"]) == \
        (False, "reported", "4")
    bad = by_id[refused.headers["x-request-id"]]
    assert (bad["stream"], bad["status_code"], bad["usage"]["total_tokens"]) == \
        (False, 400, "0")


@pytest.mark.parametrize(("model", "source"), [("mock-model", "estimated"),
                                               ("mock-other", "reported")])
def test_client_cancel_mid_stream(spoke: Spoke, keys: dict[str, str], model: str,
                                  source: str) -> None:
    c = client(spoke, keys["good"], default_headers={"x-mock-tokens-per-s": "50"})
    raw = c.chat.completions.with_raw_response.create(model=model, messages=MSG,
                                                      max_tokens=40, stream=True)
    stream = raw.parse()
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()  # the client walks away
    [event] = read_events(spoke.kafka_bootstrap, {_rid(raw)})
    assert event["outcome"] == "client_cancelled"
    assert event["usage_source"] == source
    assert event["served_model"] == model  # named by the first chunk, though cut
    got = int(event["usage"]["completion_tokens"])
    assert 4 <= got < 40
    if source == "reported":  # exact up to the cut, thanks to continuous usage stats
        sent = httpx.get(f"{spoke.engine_url}/mock/stats").json()["usage_reported"]
        assert got == sent["completion_tokens"]
    _lasted_until_its_cut(event, at_least_ms=5 / 50 * 1000)  # 5 tokens at 50/s


def _lasted_until_its_cut(event: dict[str, Any], at_least_ms: float) -> None:
    """A cut stream keeps its timing: it never sent its last byte, yet it lasted."""
    started = datetime.fromisoformat(event["started_at"])
    ended = datetime.fromisoformat(event["ended_at"])
    assert event["timing"]["duration_ms"] >= at_least_ms, event
    assert (ended - started).total_seconds() * 1000 >= at_least_ms, event


def test_engine_5xx_is_upstream_error(spoke: Spoke, keys: dict[str, str]) -> None:
    c = client(spoke, keys["good"], default_headers={"x-mock-status": "503"})
    with pytest.raises(openai.InternalServerError) as exc:
        c.chat.completions.create(model="mock-model", messages=MSG, max_tokens=3)
    rid = exc.value.response.headers["x-request-id"]
    [event] = read_events(spoke.kafka_bootstrap, {rid})
    assert event["outcome"] == "upstream_error" and event["status_code"] == 503
    assert event["usage"]["total_tokens"] == "0"


def test_denied_request_has_its_event(spoke: Spoke, keys: dict[str, str]) -> None:
    r = httpx.post(f"{spoke.base_url}/chat/completions", json={"model": "mock-model"},
                   headers={"authorization": "Bearer sk-nobody"})
    assert r.status_code == 401
    with pytest.raises(openai.PermissionDeniedError) as exc:
        client(spoke, keys["good"]).chat.completions.create(model="other-model", messages=MSG)
    ids = {r.headers["x-request-id"], exc.value.response.headers["x-request-id"]}
    events = read_events(spoke.kafka_bootstrap, ids)
    assert sorted(e["status_code"] for e in events) == [401, 403]
    assert all(e["outcome"] == "denied" for e in events)
    assert {e["key_id"] for e in events} == {"", "good"}


@pytest.mark.parametrize("how", ["x-mock-cut-after", "x-mock-fail-after"])  # RST, or FIN
def test_engine_cut_mid_stream(spoke: Spoke, keys: dict[str, str], how: str) -> None:
    """The engine dies after 5 of 40 tokens: upstream_error, not client_cancelled. Envoy
    flags it UPE (a client that left is DC). The Envoy source reads that from its record;
    ext_proc, which sees both ends the same way, borrows the flag from a record Envoy sends
    for streams that ended early. The bill is at least the tokens the client received, not a
    fixed 4 of the engine's 5: under load the chunks Envoy still held at the reset reach
    neither the sidecar nor the client (test_messages_metering's twin once billed 3)."""
    c = client(spoke, keys["good"], default_headers={how: "5", "x-mock-tokens-per-s": "200"})
    raw = c.chat.completions.with_raw_response.create(model="mock-model", messages=MSG,
                                                      max_tokens=40, stream=True)
    received = 0
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for chunk in raw.parse():
            received += bool(chunk.choices and chunk.choices[0].delta.content)
    [event] = read_events(spoke.kafka_bootstrap, {_rid(raw)})
    assert event["outcome"] == "upstream_error"
    assert event["usage_source"] == "estimated"
    assert 1 <= received <= 5
    assert received <= int(event["usage"]["completion_tokens"]) < 40
    assert event["served_model"] == "mock-model"  # the first chunk named it
    _lasted_until_its_cut(event, at_least_ms=4 / 200 * 1000)  # 5 tokens at 200/s
