"""Admission through real Envoy: concurrency leases, policy propagation, failing closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis

from devspoke.stack import Spoke
from gateway.settings import METERING_SOURCES
from testkit.spoke import (
    KEY_LIMITS,
    anthropic_client,
    chat,
    client,
    policy_doc,
    publish,
    read_events,
    start_spoke,
)


async def _stream_all(spoke: Spoke, key: str, n: int) -> list[int]:
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 10), timeout=30)
    c = openai.AsyncOpenAI(base_url=spoke.base_url, api_key=key, max_retries=0, http_client=http,
                           default_headers={"x-mock-tokens-per-s": "40"})

    async def one() -> int:
        try:
            stream = await c.chat.completions.create(
                model="mock-model", messages=[{"role": "user", "content": "hi"}],
                max_tokens=6, stream=True)
            async for _ in stream:
                pass
            return 200
        except openai.RateLimitError:
            return 429
        except openai.InternalServerError as exc:  # 503: fail closed, never admitted
            return exc.status_code

    try:
        return await asyncio.gather(*(one() for _ in range(n)))
    finally:
        await http.aclose()


@pytest.mark.serial
def test_100_streams_never_exceed_concurrency_4(spoke: Spoke, keys: dict[str, str]) -> None:
    """100 streams at once on a key limited to 4 in flight: 25x the limit.

    Serial, because how many Checks outlast Envoy's 500 ms ext_authz timeout is a matter of
    load: alone on 2 cores Envoy saw the burst's Checks take 20 ms (p50) to 58 ms (max), but
    beside seven other workers' spokes 33 of 100 ext_proc-source Checks timed out (503, fail
    closed) in a CI run (earlier: 84 of 200 on a freshly started sidecar)."""
    assert asyncio.run(_stream_all(spoke, keys["conc4"], 1)) == [200]  # a warm sidecar
    codes = asyncio.run(_stream_all(spoke, keys["conc4"], 100))
    stats = httpx.get(f"{spoke.engine_url}/mock/stats").json()
    assert codes.count(200) >= 4
    # A 503 is Envoy giving up on a Check (fail closed: nothing reached the engine), never
    # a breach of the limit; a few are tolerated on a slow machine.
    assert codes.count(200) + codes.count(429) + codes.count(503) == 100
    assert codes.count(503) <= 5, codes
    assert 1 <= stats["max_in_flight"] <= 4
    # Every lease is released at the end of its stream, not merely left to expire.
    r = redis.Redis.from_url(spoke.redis_url)
    deadline = time.monotonic() + 2
    while r.zcard("gw:conc:key:conc4") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.zcard("gw:conc:key:conc4") == 0
    assert httpx.get(f"{spoke.engine_url}/mock/stats").json()["in_flight"] == 0


def _until(predicate: object, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def _status(spoke: Spoke, key: str, model: str = "mock-model") -> int:
    r = httpx.post(f"{spoke.base_url}/chat/completions", headers={"x-api-key": key},
                   json={"model": model, "messages": [], "max_tokens": 1})
    return r.status_code


@pytest.mark.serial
def test_policy_apply_and_revoke_take_effect_within_1s(
        fresh_spoke: tuple[Spoke, dict[str, str]]) -> None:
    """Serial: the 1 s is the claim, and it counts the probes' own round trips through
    Envoy and the Check (alone ~0.1 s a change; beside seven workers a Check alone has
    taken over 500 ms). Its own two spokes: ~4 s added to the serial run."""
    spoke, keys = fresh_spoke
    assert _status(spoke, keys["revokeme"]) == 200
    from gateway.cli import main
    assert main(["keys", "revoke", "revokeme", "--redis-url", spoke.redis_url]) == 0
    assert _until(lambda: _status(spoke, keys["revokeme"]) == 401, 1.0) < 1.0
    # A new revision that allows other-model for team t1 is live within a second too.
    doc = policy_doc(keys)
    doc["teams"]["t1"]["models"] = ["*"]
    publish(spoke.redis_url, doc)
    assert _until(lambda: _status(spoke, keys["good"], "other-model") == 200, 1.0) < 1.0


def test_redis_killed_fails_closed_then_recovers(
        fresh_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = fresh_spoke
    pid = spoke["sidecar"].pid
    c = client(spoke, keys["conc4"])
    chat(c)
    spoke["redis"].kill()
    with pytest.raises(openai.InternalServerError) as exc:
        chat(c)
    assert exc.value.status_code == 503
    assert exc.value.code == "service_unavailable"
    with pytest.raises(anthropic.APIStatusError) as aexc:  # the same, in Anthropic's shape
        anthropic_client(spoke, keys["conc4"]).messages.create(
            model="mock-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert aexc.value.status_code == 503
    assert aexc.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    # Authentication still works from the snapshot held: a bad key is 401, not 503.
    with pytest.raises(openai.AuthenticationError):
        chat(client(spoke, "sk-gw-nobody-" + "B" * 43))
    spoke["redis"].restart()  # empty: no persistence; the sidecar keeps its policy snapshot
    _until(lambda: _status(spoke, keys["conc4"]) == 200, 10.0)
    chat(c)
    assert spoke["sidecar"].pid == pid  # same sidecar process, no restart needed
    publish(spoke.redis_url, policy_doc(keys))  # the hub re-publishes; instances ACK again
    assert set(KEY_LIMITS) <= set(policy_doc(keys)["keys"])


@pytest.mark.parametrize("metering", METERING_SOURCES)
def test_long_stream_keeps_its_lease_and_a_crash_frees_it(tmp_path: Path, metering: str
                                                          ) -> None:
    """(Once serial: under four workers its ext_proc orphan event missed the 20 s read. The
    restart took over two 1 s leases, and the admission's record, then kept three leases,
    expired before the new sidecar's first sweep: no event. It now waits a day.)

    Beside seven workers no deadline here is the 1 s lease: unrenewed, the lease is dead
    from 1 s on, so seeing it live past 2.5 s proves a renewal; the frees are waited for
    with bounds far below the 30 s default lease (a TTL not honoured still fails)."""
    spoke, keys = start_spoke(tmp_path / "spoke", metering=metering,
                              sidecar_env={"GATEWAY_LEASE_TTL_S": "1"})
    r = redis.Redis.from_url(spoke.redis_url)
    leases = "gw:conc:key:conc4"
    try:
        c = client(spoke, keys["conc4"], default_headers={"x-mock-tokens-per-s": "10"})
        def renewed() -> None:  # well past the 1 s lease: renewed meanwhile
            # Live at some moment from 2.5 s on (not at one instant: a loaded sidecar's
            # renewal can come late); never renewed, it would never be live again.
            _until(lambda: _live(r, leases) == 1, 2.0)

        _mid_stream(c, 2.5, renewed)
        _until(lambda: r.zcard(leases) == 0, 10.0)  # settled at the close, or swept by 1.4 s

        # A stream whose sidecar dies: nobody settles it, the lease expires on its own.
        raw = c.chat.completions.with_raw_response.create(
            model="mock-model", stream=True, max_tokens=30,
            messages=[{"role": "user", "content": "hi"}])
        stream = raw.parse()
        rid = raw.headers["x-request-id"]
        for i, _ in enumerate(stream):
            if i == 5:  # ~0.5 s in: renewed (every 1/3 s) with the usage seen so far
                break
        if metering == "ext_proc":  # the sweep bills this checkpoint: wait for it, no sleep
            _until(lambda: _checkpoint(r, rid) >= 5, 10.0)
        assert r.zcard(leases) == 1
        spoke["sidecar"].kill()
        spoke["sidecar"].restart()
        # Nobody renews it (ext_proc), or the stream's end settles it (Envoy): free well
        # before the 30 s default lease; the restart under load alone can take seconds.
        _until(lambda: _live(r, leases) == 0, 10.0)
        assert _status(spoke, keys["conc4"]) == 200
        # Its one event: with ext_proc, the orphan sweep bills the last checkpoint (not 0);
        # with the Envoy source, Envoy's record (retried until the sidecar is back) the rest.
        [event] = read_events(spoke.kafka_bootstrap, {rid}, timeout=20)
        completion = int(event["usage"]["completion_tokens"])
        if metering == "ext_proc":
            assert (event["outcome"], event["usage_source"]) == ("upstream_error", "checkpoint")
            assert 5 <= completion < 30 and int(event["usage"]["prompt_tokens"]) > 0
        else:
            assert (event["outcome"], completion) == ("completed", 30)
    finally:
        spoke.stop()


@pytest.mark.parametrize("metering", METERING_SOURCES)
def test_a_stream_that_began_outlives_the_start_ttl(tmp_path: Path, metering: str) -> None:
    """The first lease lasts GATEWAY_LEASE_START_TTL_S; the ext_proc stream renews it."""
    spoke, keys = start_spoke(tmp_path / "spoke", metering=metering, sidecar_env={
        "GATEWAY_LEASE_TTL_S": "30", "GATEWAY_LEASE_START_TTL_S": "1"})
    r = redis.Redis.from_url(spoke.redis_url)
    leases = "gw:conc:key:conc4"
    try:
        c = client(spoke, keys["conc4"], default_headers={"x-mock-tokens-per-s": "10"})
        def renewed_to_full_ttl() -> None:  # at twice the start TTL
            live_until = r.zscore(leases, r.zrange(leases, 0, 0)[0])
            assert live_until is not None and live_until > time.time() * 1000 + 20_000

        _mid_stream(c, 2.0, renewed_to_full_ttl)
        _until(lambda: r.zcard(leases) == 0, 10.0)  # settled at the close (else: 30 s lease)
    finally:
        spoke.stop()


def _mid_stream(c: openai.OpenAI, after_s: float, check: Callable[[], None]) -> None:
    """Stream, run `check` once `after_s` seconds have passed, then close the stream."""
    stream = _three_second_stream(c)
    t0 = time.monotonic()
    for _ in stream:
        if time.monotonic() - t0 > after_s:
            check()
            break
    else:
        raise AssertionError(f"the stream ended before {after_s}s: nothing was checked")
    stream.close()


def _three_second_stream(c: openai.OpenAI) -> openai.Stream[Any]:
    """30 tokens, at the 10 tokens/s the client's x-mock-tokens-per-s header asks for."""
    return c.chat.completions.create(model="mock-model", stream=True, max_tokens=30,
                                     messages=[{"role": "user", "content": "hi"}])


def _checkpoint(r: redis.Redis, rid: str) -> int:
    """The completion tokens a renewal stored for request `rid` ("prompt:completion")."""
    u = r.hget(f"gw:req:{rid}", "u")
    return int(u.split(b":")[1]) if u else 0


def _live(r: redis.Redis, key: str) -> int:
    return int(r.zcount(key, time.time() * 1000, "+inf"))
