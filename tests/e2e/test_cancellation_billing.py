"""Cancellation billing is a policy (docs/usage-events.md): each rule gives the expected
billed tokens, facts and token counter, through real Envoy, Redis and Tansu, on both
metering sources.

One policy revision names every rule at once (a platform default and two team overrides),
so each source costs one publish, six cut streams and one read of the topic."""

from __future__ import annotations

import secrets as pysecrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from devspoke.stack import Spoke
from gateway.limits import maths
from gateway.policy import secrets
from testkit.spoke import client, policy_doc, publish, read_events

MSG = [{"role": "user", "content": "count these five words"}]
# team → its own rule (None: the platform's, `delivered` here)
TEAMS = {"c_generated": "generated", "c_none": "none", "c_default": None}
PLATFORM = "delivered"
MODELS = {"mock-model": "estimated", "mock-other": "reported"}  # mock-other: continuous usage


@pytest.fixture
def cancel_keys(spoke: Spoke, keys: dict[str, str]) -> Iterator[dict[str, tuple[str, str]]]:
    """team → (key id, secret): a fresh key per team (its counters start at zero), in a
    revision with the billing rules; the test policy is restored afterwards."""
    tag = pysecrets.token_hex(4)
    made = {team: (f"{team}_{tag}", secrets.new_secret(f"{team}_{tag}")) for team in TEAMS}
    doc = policy_doc(keys)
    doc["billing"] = {"cancelled": PLATFORM}
    for team, rule in TEAMS.items():
        doc["teams"][team] = {"models": ["mock-*"]} | (
            {"billing": {"cancelled": rule}} if rule else {})
        key_id, secret = made[team]
        doc["keys"][key_id] = {"team": team, "sha256": secrets.digest(secret).hex(),
                               "limits": {"tokens_per_day": 10**6}}
    publish(spoke.redis_url, doc)
    try:
        for _, secret in made.values():  # every instance serves the revision
            _until(lambda s=secret: _served(spoke, s))
        yield made
    finally:
        publish(spoke.redis_url, policy_doc(keys))


def _served(spoke: Spoke, secret: str) -> bool:
    r = httpx.get(f"{spoke.base_url}/models", headers={"authorization": f"Bearer {secret}"})
    return r.status_code == 200


def _until(ok: Any, timeout: float = 30.0) -> None:  # a wait, not a bound: load is no failure
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _cut_stream(spoke: Spoke, secret: str, model: str) -> str:
    """A chat stream the client walks away from after 6 chunks; its request id."""
    c = client(spoke, secret, default_headers={"x-mock-tokens-per-s": "100"})
    raw = c.chat.completions.with_raw_response.create(model=model, messages=MSG,
                                                      max_tokens=40, stream=True)
    stream = raw.parse()
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    return str(raw.headers["x-request-id"])


def test_each_cancel_rule_bills_and_counts_as_it_says(
        spoke: Spoke, cancel_keys: dict[str, tuple[str, str]]) -> None:
    rids = {(team, model): _cut_stream(spoke, secret, model)
            for team, (_, secret) in cancel_keys.items() for model in MODELS}
    by_id = {e["event_id"]: e for e in read_events(spoke.kafka_bootstrap, set(rids.values()))}
    assert len(by_id) == len(rids)

    for (team, model), rid in rids.items():
        e, rule = by_id[rid], TEAMS[team] or PLATFORM
        why = f"{team} {model}"
        u, c = ({k: int(v) for k, v in d.items() if k != "billing_rule"}
                for d in (e["usage"], e["cancellation"]))
        assert e["outcome"] == "client_cancelled", why
        assert e["usage_source"] == MODELS[model], why
        assert e["cancellation"]["billing_rule"] == rule, why
        # The facts: the engine's running count (mock-other) or the estimate from what
        # streamed; what passed to the client never exceeds what was generated.
        assert 4 <= c["delivered_completion_tokens"] <= c["generated_completion_tokens"] < 40, why
        assert c["prompt_tokens"] > 0, why
        if MODELS[model] == "estimated":  # no running usage: one estimate for both
            assert c["delivered_completion_tokens"] == c["generated_completion_tokens"], why
        billed = {"generated": c["generated_completion_tokens"],
                  "delivered": c["delivered_completion_tokens"], "none": 0}[rule]
        prompt = 0 if rule == "none" else c["prompt_tokens"]
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (
            prompt, billed, prompt + billed), why

    # The token counters settle by the same rule: each key's day counts what was billed.
    r = redis.Redis.from_url(spoke.redis_url)
    _until(lambda: not any(r.exists(f"gw:req:{rid}") for rid in rids.values()))
    day = maths.day_id(time.time())
    for team, (key_id, _) in cancel_keys.items():
        billed = sum(int(by_id[rids[team, m]]["usage"]["total_tokens"]) for m in MODELS)
        counter = r.get(f"gw:tpd:key:{key_id}:{day}")
        assert counter is not None and int(counter) == billed, team  # reserved, then settled
