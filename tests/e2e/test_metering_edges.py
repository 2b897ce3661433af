"""End cases of "one usage event per request" through real Envoy, both metering sources:
an engine that compresses its answers, requests that end before any answer reached the
client, and methods that carry no body."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
import pytest
import redis

from devspoke.stack import Spoke
from devspoke.usage_topic import read_topic
from testkit.spoke import client, read_events

MSG = [{"role": "user", "content": "count these five words"}]


def _after(spoke: Spoke, t0: datetime, settle: float) -> list[dict]:
    """The events of requests started after `t0` (the spoke is shared, its tests serial),
    read once there is one and `settle` more seconds brought no other (so a duplicate
    would show), or at 15 s."""
    out: list[dict] = []

    def keep(m: Any) -> bool:
        if m.value and datetime.fromisoformat((e := orjson.loads(m.value))["started_at"]) >= t0:
            out.append(e)
            return True
        return False

    asyncio.run(read_topic(spoke.kafka_bootstrap, keep, lambda: bool(out), settle=settle))
    return out


def _engine_done(spoke: Spoke, timeout: float = 15.0) -> None:
    """Until the engine has had a request and finished every one it had."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(f"{spoke.engine_url}/mock/stats").json()
        if stats["requests"] >= 1 and stats["in_flight"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the engine still busy: {stats}")


def _read_until(bootstrap: str, ids: set[str], last: str, grace: float,
                settle: float = 0.5) -> list[dict]:
    """The events of `ids`: once all are seen and `settle` more seconds brought nothing (so
    a duplicate would show), or `grace` seconds after the event of `last` (the last request
    sent), or at 15 s."""
    out: list[dict] = []
    last_seen: list[float] = []

    def keep(m: Any) -> bool:
        if not m.value or (e := orjson.loads(m.value))["event_id"] not in ids:
            return False
        out.append(e)
        if e["event_id"] == last and not last_seen:
            last_seen.append(time.monotonic())
        return True

    def done() -> bool:
        return ({e["event_id"] for e in out} >= ids
                or (bool(last_seen) and time.monotonic() - last_seen[0] >= grace))

    asyncio.run(read_topic(bootstrap, keep, done, settle=settle))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_engine_that_compresses_is_metered_from_what_it_reported(
        spoke: Spoke, keys: dict[str, str], stream: bool) -> None:
    """The openai SDK asks for gzip (httpx's default Accept-Encoding); an engine behind a
    compressing proxy answers so. Neither Envoy's filters nor ext_proc can read compressed
    bytes: the request goes to the engine without Accept-Encoding, so its answer is plain."""
    c = client(spoke, keys["good"], default_headers={"x-mock-compress": "1"})
    raw = c.chat.completions.with_raw_response.create(
        model="mock-model", messages=MSG, max_tokens=5, stream=stream)
    if stream:
        assert len(list(raw.parse())) >= 5  # no usage chunk: the client did not ask for it
    else:
        assert raw.parse().usage.completion_tokens == 5
    [e] = read_events(spoke.kafka_bootstrap, {raw.headers["x-request-id"]})
    assert (e["outcome"], e["usage_source"]) == ("completed", "reported")
    engine = httpx.get(f"{spoke.engine_url}/mock/stats").json()["usage_reported"]
    assert int(e["usage"]["completion_tokens"]) == engine["completion_tokens"] == 5


@pytest.mark.parametrize("how", ["x-mock-cut-after", "x-mock-fail-after"])  # RST, or FIN
def test_a_stream_cut_before_its_first_byte(spoke: Spoke, keys: dict[str, str],
                                            how: str) -> None:
    """The engine sent its 200 and SSE headers, then died before any event: upstream_error,
    status 200, the prompt billed (estimated), from either source (ext_proc, which never saw
    the status, once said 0 and billed nothing)."""
    with httpx.stream("POST", f"{spoke.base_url}/chat/completions",
                      headers={"authorization": f"Bearer {keys['good']}", how: "0"},
                      json={"model": "mock-model", "messages": MSG, "max_tokens": 5,
                            "stream": True}) as r:
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):
            r.read()
        rid = r.headers["x-request-id"]
    [e] = read_events(spoke.kafka_bootstrap, {rid})
    assert (e["outcome"], e["status_code"], e["usage_source"]) == (
        "upstream_error", 200, "estimated")
    assert int(e["usage"]["prompt_tokens"]) > 0 and e["usage"]["completion_tokens"] == "0"


def test_a_client_gone_before_the_response_headers(spoke: Spoke, keys: dict[str, str]) -> None:
    """The engine is still thinking (no header yet) when the client hangs up: one event,
    client_cancelled, no status, and nothing billed (no answer was begun)."""
    t0 = datetime.now(UTC)
    with httpx.Client(timeout=httpx.Timeout(5.0, read=0.5)) as c:
        try:
            c.post(f"{spoke.base_url}/chat/completions",
                   headers={"authorization": f"Bearer {keys['good']}", "x-mock-ttft-ms": "2500"},
                   json={"model": "mock-model", "messages": MSG, "max_tokens": 5})
            raise AssertionError("answered before the client's timeout")
        except httpx.ReadTimeout:
            pass
    _engine_done(spoke)  # the engine finishes its answer into a closed stream
    events = _after(spoke, t0, settle=3.0)
    assert len(events) == 1, events
    [e] = events
    assert (e["outcome"], e["status_code"], e["key_id"]) == ("client_cancelled", 0, "good")
    assert e["usage"]["total_tokens"] == "0" and e["usage_source"] == "estimated"


def test_head_and_options_on_an_inference_path(spoke: Spoke, keys: dict[str, str]) -> None:
    """Not an inference call: refused by the Check, one denied event each. A HEAD's answer
    has no body: under ext_proc metering the Check emits its event itself, marked `metered`,
    and the stream its response headers open (SEND off the API's POST routes) emits none:
    exactly once (2 s settle)."""
    auth = {"authorization": f"Bearer {keys['good']}"}
    ids = {}
    for method in ("HEAD", "OPTIONS"):
        r = httpx.request(method, f"{spoke.base_url}/chat/completions", headers=auth)
        assert r.status_code >= 400, (method, r.status_code)
        ids[method] = r.headers["x-request-id"]
    # HEAD's event, if any, comes no later than 3 s after that of OPTIONS, sent after it
    events = _read_until(spoke.kafka_bootstrap, set(ids.values()), ids["OPTIONS"], grace=3.0,
                         settle=2.0)
    assert len(events) == 2
    assert sorted(e["event_id"] for e in events) == sorted(ids.values())
    assert all(e["outcome"] == "denied" and e["usage_source"] == "" for e in events)
    head = next(e for e in events if e["event_id"] == ids["HEAD"])
    assert (head["status_code"], head["key_id"]) == (404, "good")


def test_a_refused_head_without_a_key_gets_its_event_once(spoke: Spoke) -> None:
    """Refused before any key is known (401): still exactly one denied event."""
    r = httpx.head(f"{spoke.base_url}/chat/completions")
    assert r.status_code == 401 and r.content == b""
    rid = r.headers["x-request-id"]
    events = _read_until(spoke.kafka_bootstrap, {rid}, rid, grace=3.0, settle=2.0)
    assert [(e["event_id"], e["outcome"], e["status_code"]) for e in events] == [
        (rid, "denied", 401)]


def _all_events_of(spoke: Spoke, keys: dict[str, str], rid: str) -> list[dict]:
    """Each event of `rid`. A refused OPTIONS sent after it (an event on either source)
    marks how far to read: `rid`'s event, if any, comes no later than 3 s after the
    OPTIONS's, so a missing one fails fast, not at 15 s."""
    marker = httpx.request("OPTIONS", f"{spoke.base_url}/chat/completions",
                           headers={"authorization": f"Bearer {keys['good']}"})
    mid = marker.headers["x-request-id"]
    events = _read_until(spoke.kafka_bootstrap, {rid, mid}, mid, grace=3.0, settle=2.0)
    assert mid in {e["event_id"] for e in events}  # the topic was read far enough
    return [e for e in events if e["event_id"] == rid]


def _events_of(spoke: Spoke, keys: dict[str, str], rid: str) -> list[tuple[str, int]]:
    """The (outcome, status) of each event of `rid` (`_all_events_of`)."""
    return [(e["outcome"], e["status_code"]) for e in _all_events_of(spoke, keys, rid)]


def test_an_allowed_head_gets_one_event(spoke: Spoke, keys: dict[str, str]) -> None:
    """A HEAD the policy lets through (testkit's passthrough `HEAD /v1/models`): the engine
    answers 200 with no body, one completed event. No body either way: under ext_proc
    metering only the response headers (SEND) open its stream, their end_of_stream ends it."""
    r = httpx.head(f"{spoke.base_url}/models",
                   headers={"authorization": f"Bearer {keys['good']}"})
    assert r.status_code == 200 and r.content == b""
    assert _events_of(spoke, keys, r.headers["x-request-id"]) == [("completed", 200)]


@pytest.mark.parametrize(("status", "body"), [(204, b""), (204, b'{"prompt": "a b c"}'),
                                              (304, b"")])
def test_a_passthrough_answer_with_no_body_gets_one_event(
        spoke: Spoke, keys: dict[str, str], status: int, body: bytes) -> None:
    """A pass-through path (testkit's `POST /tokenize`) the engine answers 204 or 304, with
    no body, to a request with a body or none: one completed event with that status. Under
    ext_proc metering, with response headers SKIP, one with no request body opened no
    stream (no event) and one with a body a stream that never saw its end (a
    client_cancelled event, status 0)."""
    r = httpx.post(f"{spoke.base_url.removesuffix('/v1')}/tokenize", content=body,
                   headers={"authorization": f"Bearer {keys['good']}",
                            "x-mock-status": str(status)})
    assert r.status_code == status and r.content == b""
    assert _events_of(spoke, keys, r.headers["x-request-id"]) == [("completed", status)]


@pytest.mark.parametrize(("status", "empty", "outcome"), [
    (204, False, "completed"), (304, False, "completed"), (200, True, "completed"),
    (404, True, "completed"), (500, True, "upstream_error")])
def test_an_api_answer_with_no_body_gets_its_status(
        spoke: Spoke, keys: dict[str, str], status: int, empty: bool, outcome: str) -> None:
    """A chat completion the engine answers with no body at all (a 204 or 304, or any status
    with content-length: 0): one event, with the engine's status and outcome; a success
    bills the prompt (estimated) and no completion, an error nothing. Under ext_proc
    metering (response headers SKIP on the API's POST routes) no response message opens
    for it: the stream ended without its end, and the event said client_cancelled, status
    0, until Envoy's record of a bodiless answer told the sidecar how it ended."""
    headers = {"authorization": f"Bearer {keys['good']}", "x-mock-status": str(status)}
    if empty:
        headers["x-mock-empty"] = "1"
    r = httpx.post(f"{spoke.base_url}/chat/completions", headers=headers,
                   json={"model": "mock-model", "messages": MSG, "max_tokens": 5})
    assert r.status_code == status and r.content == b""
    events = _all_events_of(spoke, keys, r.headers["x-request-id"])
    assert [(e["outcome"], e["status_code"]) for e in events] == [(outcome, status)]
    [e] = events
    usage = e["usage"]
    assert usage["completion_tokens"] == "0"
    if status < 400:
        assert int(usage["prompt_tokens"]) > 0 and e["usage_source"] == "estimated"
    else:
        assert usage["total_tokens"] == "0" and e["usage_source"] == "reported"


def _response_headers_seen(spoke: Spoke) -> float:
    text = httpx.get(f"{spoke.metrics_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('gateway_extproc_messages_total{kind="response_headers"'))


def test_ext_proc_is_sent_response_headers_but_on_an_api_post(spoke: Spoke,
                                                              keys: dict[str, str]) -> None:
    """ext_proc metering: a chat completion's stream has no response_headers message (its
    route's override, SKIP: no extra message on the inference path), an allowed HEAD's
    one (the filter's SEND: the stream that gives it its event)."""
    if spoke.metering != "ext_proc":
        pytest.skip("ext_proc metering only")
    auth = {"authorization": f"Bearer {keys['good']}"}
    before = _response_headers_seen(spoke)
    r = httpx.post(f"{spoke.base_url}/chat/completions?x=1", headers=auth,
                   json={"model": "mock-model", "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200
    assert _response_headers_seen(spoke) == before
    assert httpx.head(f"{spoke.base_url}/models", headers=auth).status_code == 200
    assert _response_headers_seen(spoke) == before + 1



LEASES = "gw:conc:key:conc4"  # conc4's concurrency leases, by request id


@pytest.mark.parametrize(("status", "empty", "outcome"), [
    (400, True, "completed"), (204, False, "completed"), (500, True, "upstream_error"),
    (413, False, "completed")], ids=["400-empty", "204", "500-empty", "413-json"])
def test_an_answer_before_the_engine_read_the_body_gets_its_status(
        spoke: Spoke, keys: dict[str, str], status: int, empty: bool, outcome: str) -> None:
    """The engine (or a proxy before it) answers a 3 MB chat completion from its headers
    alone, before it read the body (the mock's x-mock-early), with no body or with its JSON
    error: each request one event, with that status and outcome, at its answer (not the
    orphan sweep's, a lease later), and its concurrency lease released at once; a key with
    no lease too. Under ext_proc metering (request headers SKIP) Envoy let the headers on
    to the engine before the sidecar had the body: a bodiless answer then reset the stream
    before its body message arrived, and about a third of such requests had no event (the
    orphan sweep's, upstream_error with status 0, ~10 s later, for a leased key). Four
    requests, so that a race lost a third of the time shows."""
    body = {"model": "mock-model", "messages": MSG, "max_tokens": 5, "user": "x" * (3 << 20)}
    leases = redis.Redis.from_url(spoke.redis_url)
    rids = []
    for key in ("conc4", "good", "conc4", "good"):
        headers = {"authorization": f"Bearer {keys[key]}", "x-mock-status": str(status),
                   "x-mock-early": "1"}
        if empty:
            headers["x-mock-empty"] = "1"
        r = httpx.post(f"{spoke.base_url}/chat/completions", headers=headers, json=body,
                       timeout=10.0)
        assert r.status_code == status
        assert (r.content == b"") == (empty or status == 204)
        rids.append(rid := r.headers["x-request-id"])
        deadline = time.monotonic() + 2.0
        while leases.zscore(LEASES, rid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leases.zscore(LEASES, rid) is None, key  # released, not left to the sweep
    marker = httpx.request("OPTIONS", f"{spoke.base_url}/chat/completions",
                           headers={"authorization": f"Bearer {keys['good']}"})
    mid = marker.headers["x-request-id"]
    events = _read_until(spoke.kafka_bootstrap, {*rids, mid}, mid, grace=3.0, settle=2.0)
    assert mid in {e["event_id"] for e in events}  # the topic was read far enough
    events = sorted((e for e in events if e["event_id"] != mid),
                    key=lambda e: rids.index(e["event_id"]))
    assert [(e["event_id"], e["outcome"], e["status_code"]) for e in events] == [
        (rid, outcome, status) for rid in rids]
    for e in events:
        took = datetime.fromisoformat(e["ended_at"]) - datetime.fromisoformat(e["started_at"])
        assert took.total_seconds() < 2.0  # at its answer, not the orphan sweep's
        usage = e["usage"]
        assert usage["completion_tokens"] == "0"
        if status < 400:
            assert int(usage["prompt_tokens"]) > 0 and e["usage_source"] == "estimated"
        else:
            assert usage["total_tokens"] == "0"
