"""Token weights (docs/policy.md "Weighted tokens") through the real spoke, on both metering
sources: a model with `token_weights` charges its token windows the weighted count of what
the engine reported (cache reads cheap, completion dear), so the next answer's remaining
tokens fall by that; the usage event's usage stays the raw counts; `keys show` says its
numbers are weighted."""

from __future__ import annotations

import math
import secrets as pysecrets
import time
from collections.abc import Iterator
from fractions import Fraction

import httpx
import orjson
import pytest
import redis

from devspoke.stack import Spoke
from gateway.cli import main
from gateway.policy import secrets
from testkit.spoke import policy_doc, publish, read_events

ALSO_GRPC_CHECK = True  # the weights ride the gRPC Check's metadata as the HTTP door's
TPM = 10**6
WEIGHTS = {"input": 1, "cached_input": 0.1, "cache_creation": 1.25, "output": 4}
WORDS = " ".join(f"word{i}" for i in range(60))  # a prompt long enough for its cache split
CACHE = {"x-mock-cache-read-tokens": "30", "x-mock-cache-creation-tokens": "8"}


@pytest.fixture
def weighted(spoke: Spoke, keys: dict[str, str]) -> Iterator[tuple[str, str]]:
    """A fresh key with a tokens_per_minute limit, in a revision that weights mock-model's
    tokens; the test policy is restored afterwards."""
    key_id = f"weigh_{pysecrets.token_hex(4)}"
    secret = secrets.new_secret(key_id)
    doc = policy_doc(keys)
    doc["models"]["mock-model"] = {"token_weights": WEIGHTS}
    doc["keys"][key_id] = {"team": "t1", "sha256": secrets.digest(secret).hex(),
                           "models": ["mock-model"],
                           "limits": {"concurrency": 8, "tokens_per_minute": TPM}}
    publish(spoke.redis_url, doc)
    try:
        deadline = time.monotonic() + 30  # a wait, not a bound: load is no failure
        while httpx.get(f"{spoke.base_url}/models",
                        headers={"authorization": f"Bearer {secret}"}).status_code != 200:
            assert time.monotonic() < deadline, "the revision was not served"
            time.sleep(0.02)
        yield key_id, secret
    finally:
        publish(spoke.redis_url, policy_doc(keys))


def _weighed(u: dict[str, str]) -> int:
    """The docs' formula, in exact fractions (not the gateway's own function)."""
    p, c = int(u["prompt_tokens"]), int(u["completion_tokens"])
    read, made = int(u["cached_tokens"]), int(u["cache_creation_tokens"])
    w = {k: Fraction(str(v)) for k, v in WEIGHTS.items()}
    return math.ceil(w["input"] * max(0, p - read - made) + w["cached_input"] * read
                     + w["cache_creation"] * made + w["output"] * c)


def test_a_weighted_model_charges_its_token_window_the_weighted_count(
        spoke: Spoke, weighted: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    key_id, secret = weighted
    if time.time() % 60 > 40:  # the three requests in one minute: no previous one sliding
        time.sleep(60.5 - time.time() % 60)
    minute = int(time.time() // 60)
    r = redis.Redis.from_url(spoke.redis_url)
    rids, remaining = [], []
    for stream in (True, False, True):  # the same body each time: the same reservation
        raw = httpx.post(f"{spoke.base_url}/messages", headers={
            "x-api-key": secret, "anthropic-version": "2023-06-01", **CACHE}, json={
            "model": "mock-model", "max_tokens": 7, "stream": stream,
            "messages": [{"role": "user", "content": WORDS}]}, timeout=30)
        assert raw.status_code == 200, raw.text
        rids.append(raw.headers["x-request-id"])
        remaining.append(int(raw.headers["anthropic-ratelimit-tokens-remaining"]))
        deadline = time.monotonic() + 10  # settled: its reservation replaced by its count
        while r.exists(f"gw:req:{rids[-1]}"):
            assert time.monotonic() < deadline, "the admission was not settled"
            time.sleep(0.02)
    by_id = {e["event_id"]: e for e in read_events(spoke.kafka_bootstrap, set(rids))}
    usages = [by_id[rid]["usage"] for rid in rids]
    for u in usages:  # the event's usage is raw: the engine's counts, priced by `prices`
        assert (int(u["cached_tokens"]), int(u["cache_creation_tokens"]),
                int(u["completion_tokens"])) == (30, 8, 7)
        assert int(u["total_tokens"]) == int(u["prompt_tokens"]) + 7
    charged = [_weighed(u) for u in usages]
    assert charged[0] != int(usages[0]["total_tokens"])  # weighted differs from raw here
    reserved = TPM - remaining[0]  # a fresh key: the first answer's remaining, its own
    assert reserved >= 4 * 7 + int(usages[0]["prompt_tokens"]) // 2  # output at 4 (and more)
    # each answer's remaining counts the request before it at its weighted size
    assert remaining[0] - remaining[1] == charged[0]
    assert remaining[1] - remaining[2] == charged[1]

    assert main(["keys", "show", key_id, "--redis-url", spoke.redis_url, "-o", "json"]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert shown["token_weights"] == {"mock-model": {k: float(v) for k, v in WEIGHTS.items()}}
    [key] = [t for t in shown["tiers"] if t["tier"] == "key"]
    tpm = {w["limit"]: w for w in key["windows"]}["tokens_per_minute"]
    assert tpm["used"] == sum(charged)  # the minute holds the three at their weighted sizes
    assert int(time.time() // 60) == minute, "the requests spanned two minutes"
    assert main(["keys", "show", key_id, "--redis-url", spoke.redis_url]) == 0
    assert "weighted tokens" in capsys.readouterr().out
