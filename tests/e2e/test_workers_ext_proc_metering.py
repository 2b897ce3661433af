"""GATEWAY_WORKERS=2 with the ext_proc metering source, through a real Envoy with two
workers (`--concurrency 2`): every request still gets exactly one usage event, with the
right outcome and status, and the token quota falls by exactly the usage billed.

The risk this covers: with ext_proc, the event of a stream that ended early (a client that
left, an engine that cut it, an answer with no body) waits in the process that ran its
ext_proc stream for Envoy's early-end record, which says who ended it (UPE vs DC) and the
status. That word is paired in memory (Recorder.told / finish_cut), so it must reach the
same process as the stream: were it read by another worker, an engine cut would become
client_cancelled and a 204 a client_cancelled with status 0, after a second's wait.

Several requests of each kind run at once, each on its own client connection, so both
Envoy workers carry them; each Envoy worker has its own HTTP/2 connection to the sidecar,
which SO_REUSEPORT hands to either sidecar worker. The Check goes through the HTTP door
(HTTP/1.1, one connection per Check in flight): served by either worker, or by a door
worker, so the process that admits a request is often not the one that settles it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import redis

from devspoke.stack import Spoke
from gateway.cli import main
from testkit.spoke import read_events, start_spoke

KEY = "fault"  # concurrency 64, tokens_per_day 10**9: this module's spoke alone uses it
MSG = [{"role": "user", "content": "count these five words"}]
EACH = 5  # requests of each kind, all at once: 35 in flight


@pytest.fixture(params=["workers2", "workers2-door1-records-http"], scope="module")
def spoke_and_key(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[Spoke, str]]:
    """Two sidecar workers serving the HTTP door too; or beside one door worker, with Envoy
    rendered `--records-http`, which sent ext_proc's early-end records over OTLP/HTTP to
    either worker: engine cuts and bodiless answers were then often billed as
    client_cancelled (now the records stay on gRPC with the streams)."""
    env = {"GATEWAY_WORKERS": "2"}
    door1 = request.param.startswith("workers2-door1")
    if door1:
        env["GATEWAY_DOOR_WORKERS"] = "1"
    spoke, keys = start_spoke(tmp_path_factory.mktemp("spoke"), metering="ext_proc",
                              authz_http=True, envoy_workers=2, sidecar_env=env,
                              records_http=door1)
    try:
        yield spoke, keys[KEY]
    finally:
        spoke.stop()


def _headers(secret: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}", **extra}


def _body(stream: bool, max_tokens: int = 4) -> dict[str, object]:
    return {"model": "mock-model", "messages": MSG, "max_tokens": max_tokens, "stream": stream}


def _whole(url: str, secret: str, stream: bool, **extra: str) -> tuple[str, int]:
    """One request read to its end, on a connection of its own: its id and status."""
    with httpx.Client(timeout=30) as c, c.stream(
            "POST", url, headers=_headers(secret, **extra), json=_body(stream)) as r:
        r.read()
        return r.headers["x-request-id"], r.status_code


def _client_leaves(url: str, secret: str) -> tuple[str, int]:
    """A slow stream the client drops after its first content event."""
    with httpx.Client(timeout=30) as c, c.stream(
            "POST", url, json=_body(True, 60),
            headers=_headers(secret, **{"x-mock-tokens-per-s": "20"})) as r:
        for line in r.iter_lines():
            if '"content"' in line:
                break
        return r.headers["x-request-id"], r.status_code  # closed unread: a disconnect


def _engine_cuts(how: str) -> Callable[[str, str], tuple[str, int]]:
    """A stream the engine ends after 3 of 40 tokens: a TCP reset (cut) or a close (fail)."""
    def run(url: str, secret: str) -> tuple[str, int]:
        with httpx.Client(timeout=30) as c, c.stream(
                "POST", url, json=_body(True, 40),
                headers=_headers(secret, **{how: "3", "x-mock-tokens-per-s": "200"})) as r:
            with pytest.raises(httpx.HTTPError):
                r.read()
            return r.headers["x-request-id"], r.status_code
    return run


# kind → (the request, the (outcome, status) its one event must have)
KINDS: dict[str, tuple[Callable[[str, str], tuple[str, int]], tuple[str, int]]] = {
    "json": (lambda u, s: _whole(u, s, False), ("completed", 200)),
    "sse": (lambda u, s: _whole(u, s, True), ("completed", 200)),
    "client_left": (_client_leaves, ("client_cancelled", 200)),
    "engine_reset": (_engine_cuts("x-mock-cut-after"), ("upstream_error", 200)),
    "engine_closed": (_engine_cuts("x-mock-fail-after"), ("upstream_error", 200)),
    "no_body_204": (lambda u, s: _whole(u, s, False, **{"x-mock-status": "204"}),
                    ("completed", 204)),
    "empty_200": (lambda u, s: _whole(u, s, False, **{"x-mock-status": "200",
                                                      "x-mock-empty": "1"}),
                  ("completed", 200)),
}


def _used_today(spoke: Spoke, capsys: pytest.CaptureFixture[str]) -> int:
    assert main(["keys", "show", KEY, "--redis-url", spoke.redis_url, "-o", "json"]) == 0
    [key] = [t for t in orjson.loads(capsys.readouterr().out)["tiers"] if t["tier"] == "key"]
    return int({w["limit"]: w for w in key["windows"]}["tokens_per_day"]["used"])


def _settled(r: redis.Redis) -> None:
    """Until no admission holds anything in Redis (every one settled)."""
    deadline = time.monotonic() + 15
    while held := [*r.keys("gw:req:*"), *[k for k in r.keys("gw:conc:*") if r.zcard(k)]]:
        assert time.monotonic() < deadline, held
        time.sleep(0.05)


def test_each_request_gets_one_event_with_its_outcome_across_workers(
        spoke_and_key: tuple[Spoke, str], capsys: pytest.CaptureFixture[str]) -> None:
    """35 requests at once, five of each kind: one event each, none lost, each with its
    kind's outcome and status and usage; every admission settled, and the key's day
    window grown by exactly the tokens the events bill (the reservations replaced)."""
    spoke, secret = spoke_and_key
    url = f"{spoke.base_url}/chat/completions"
    before = _used_today(spoke, capsys)
    jobs = [kind for kind in KINDS for _ in range(EACH)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda kind: KINDS[kind][0](url, secret), jobs))
    want = {rid: KINDS[kind][1] for kind, (rid, _) in zip(jobs, answers, strict=True)}
    assert len(want) == len(jobs)
    assert [status for _, status in answers] == [KINDS[k][1][1] for k in jobs]
    events = read_events(spoke.kafka_bootstrap, set(want), settle=2.0)  # past CUT_WAIT_S
    assert sorted(e["event_id"] for e in events) == sorted(want)  # one each, none lost
    got = {e["event_id"]: (e["outcome"], e["status_code"]) for e in events}
    wrong = {(kind, want[rid], got[rid]) for kind, (rid, _) in zip(jobs, answers, strict=True)
             if got[rid] != want[rid]}
    by_worker: dict[str, int] = {}
    for e in events:
        worker = e["instance_id"].rsplit("-", 1)[1]
        by_worker[worker] = by_worker.get(worker, 0) + 1
    assert set(by_worker) <= {"w0", "w1"}, by_worker  # where the ext_proc streams ran
    assert not wrong, (by_worker, sorted(wrong))
    kind_of = {rid: kind for kind, (rid, _) in zip(jobs, answers, strict=True)}
    for e in events:
        kind, u = kind_of[e["event_id"]], e["usage"]
        prompt, completion = int(u["prompt_tokens"]), int(u["completion_tokens"])
        if kind in ("json", "sse"):  # what the engine reported
            assert (e["usage_source"], completion) == ("reported", 4) and prompt > 0, e
        elif kind.startswith("engine_"):  # the prompt and what streamed before the cut
            assert e["usage_source"] == "estimated" and prompt > 0 and 1 <= completion < 40, e
        elif kind in ("no_body_204", "empty_200"):  # the prompt, no completion
            assert (e["usage_source"], completion) == ("estimated", 0) and prompt > 0, e
    _settled(redis.Redis.from_url(spoke.redis_url))
    billed = sum(int(e["usage"]["total_tokens"]) for e in events)
    assert billed > 0
    assert _used_today(spoke, capsys) - before == billed  # settled to exactly the usage
