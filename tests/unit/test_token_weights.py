"""Token weights (docs/policy.md "Weighted tokens"): the one function the limits count with,
the schema, the weighted reservation and its 429, the hand-off to metering, the weighted
settlement and checkpoints, `keys show`; and a model without weights exactly as before."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import keys_show
from gateway.authz import answers
from gateway.authz.decision import Allow, Caller
from gateway.hub.quota_ledger import QuotaLedger
from gateway.limits import maths
from gateway.limits.types import Refused
from gateway.metering import billing, handoff
from gateway.metering.facts import ResponseFacts
from gateway.metering.meter import Meter
from gateway.metering.recorder import Recorder, settlements
from gateway.policy.loader import load
from gateway.sinks.spool import Spool
from gateway.token_weights import TokenWeights, limit_tokens
from gateway.usage_event import Usage, rfc3339
from tests.unit.test_authz_engine import SECRETS, Gate, chat, denied, sha

W = TokenWeights(input=1, cached_input=0.1, cache_creation=1.25, output=4)


def usage(prompt: int, completion: int, cached: int = 0, created: int = 0) -> Usage:
    return Usage(prompt, completion, prompt + completion, cached, 0, created)


# --- the pure function ------------------------------------------------------------------

def test_limit_tokens_weighs_each_kind_and_rounds_up() -> None:
    # 1 x (100 - 40 - 8) + 0.1 x 40 + 1.25 x 8 + 4 x 7 = 52 + 4 + 10 + 28
    assert limit_tokens(usage(100, 7, cached=40, created=8), W) == 94
    assert limit_tokens(usage(3, 0, cached=3), W) == 1  # 0.3, rounded up
    assert limit_tokens(usage(1000, 0, cached=1000), W) == 100  # 0.1 x 1000 is not 101
    assert limit_tokens(usage(0, 0), W) == 0
    assert limit_tokens(usage(10, 5), TokenWeights(0, 0, 0, 0)) == 0


def test_the_uncached_part_is_never_below_zero() -> None:
    """An engine that reports more cached than prompt tokens is not credited for it."""
    assert limit_tokens(usage(10, 0, cached=30), W) == 3  # 0.1 x 30, no -20 uncached


def test_without_weights_the_count_is_the_total_as_before() -> None:
    u = Usage(10, 5, 17, 4, 2, 1)  # an engine's own total is what was settled before
    assert limit_tokens(u, None) == 17


def test_the_reservation_takes_the_largest_input_weight() -> None:
    assert W.reserve(100, 50) == 125 + 200  # the cache unknown: 1.25 for every prompt token
    assert TokenWeights(cached_input=0.1, output=0.5).reserve(10, 3) == 12  # 10 + 1.5, up
    assert TokenWeights(0.5, 0.5, 0.5, 0.5).reserve(10, 3) == 7  # all below 1: 6.5, up


def test_the_weights_text_reads_back() -> None:
    assert W.text() == "1:0.1:1.25:4"
    assert TokenWeights.parse(W.text()) == W
    for bad in ("", "1:2:3", "1:x:1:1", "1:nan:1:1", "1:1:1:1001", "1:-1:1:1"):
        assert TokenWeights.parse(bad) is None, bad


# --- the schema and the compiled policy ----------------------------------------------------

def _doc(weights: str) -> str:
    return f"models:\n  m: {{token_weights: {weights}}}\n  plain: {{}}\n"


def test_weights_compile_per_model_only_when_not_all_one() -> None:
    p = load(_doc("{input: 1, cached_input: 0.1, cache_creation: 1.25, output: 4}"), 1)
    assert p.token_weights("m") == W and p.token_weights("plain") is None
    assert p.token_weights("unknown") is None
    assert load(_doc("{output: 2}"), 1).token_weights("m") == TokenWeights(output=2)
    for same in ("{}", "{input: 1, cached_input: 1.0, cache_creation: 1, output: 1}"):
        assert load(_doc(same), 1).weights == {}, same  # today's count: nothing weighted
    assert load("models:\n  m: {}\n", 1).weights == {}


@pytest.mark.parametrize(("weights", "path"), [
    ("{output: -1}", "models.m.token_weights.output"),
    ("{input: 1001}", "models.m.token_weights.input"),
    ("{cached_input: .nan}", "models.m.token_weights.cached_input"),
    ("{cache_creation: .inf}", "models.m.token_weights.cache_creation"),
    ("{output: true}", "models.m.token_weights.output"),
    ("{cached: 0.1}", "models.m.token_weights.cached"),
    ("4", "models.m.token_weights"),
])
def test_a_bad_weight_is_refused_naming_its_path(weights: str, path: str) -> None:
    with pytest.raises(Exception) as info:
        load(_doc(weights), 1)
    assert path in str(info.value)


# --- the Check ----------------------------------------------------------------------------

def _policy(weights: str = "{input: 1, cached_input: 0.1, cache_creation: 1.25, output: 4}",
            limits: str = "{tokens_per_minute: 100000}") -> Any:
    return load(f"""
models:
  qwen3-coder: {{limits: {limits}, token_weights: {weights}}}
  llama-3: {{limits: {limits}}}
teams:
  team-a: {{models: ["*"]}}
keys:
  alice: {{team: team-a, sha256: "{sha("alice")}"}}
""", revision=1)


async def test_the_check_reserves_weighted_tokens_and_hands_the_weights_over() -> None:
    gate = Gate(_policy())
    d = await gate.check(chat(max_tokens=100))  # a prompt estimate of 5
    assert isinstance(d, Allow)
    assert d.context.reserved == math.ceil(1.25 * 5 + 4 * 100)
    assert d.rate.tok_remaining == 100000 - d.context.reserved
    shared = d.context.caller.shared("/v1/chat/completions", False, True, False, False, False)
    assert shared.metadata["token_weights"] == "1:0.1:1.25:4"
    plain = await gate.check(chat("llama-3", max_tokens=100))
    assert isinstance(plain, Allow) and plain.context.reserved == 5 + 100  # as before
    shared = plain.context.caller.shared("/v1/chat/completions", False, True, False, False,
                                         False)
    assert "token_weights" not in shared.metadata


async def test_an_impossible_weighted_request_says_its_tokens_are_weighted() -> None:
    gate = Gate(_policy(limits="{tokens_per_minute: 1000}"))
    d = denied(await gate.check(chat(max_tokens=300)), 429, "rate_limit_exceeded")
    assert "never pass" in d.message
    assert ("It needs 1207 weighted tokens (prompt estimate 5 x 1.25 + completion 300 x 4: "
            "the model's token_weights, the prompt at its largest input weight)") in d.message
    plain = denied(await gate.check(chat("llama-3", max_tokens=2000)), 429,
                   "rate_limit_exceeded")
    assert "It needs 2005 tokens (prompt estimate 5 + completion 2000)" in plain.message


def test_a_default_callers_metadata_is_what_it_always_was() -> None:
    """No weights: byte for byte the entries (and their order) of before."""
    md = handoff.caller("k", "t", "m", "/v1/chat/completions", True, True, False, True, False)
    assert orjson.dumps(md) == (
        b'{"key_id":"k","team":"t","model":"m","stream":true,"leased":true,'
        b'"endpoint":"/v1/chat/completions","stream_options":false,"include_usage":true,'
        b'"continuous_usage":false,"cancelled":"generated"}')
    assert Caller("k", "t", "m").shared("/e", True, True, False, True, False).metadata == \
        handoff.caller("k", "t", "m", "/e", True, True, False, True, False)


# --- metering -------------------------------------------------------------------------------

def _facts(weights: TokenWeights | None) -> handoff.RequestFacts:
    md = {**handoff.allowed("r1", 500, 100),
          **handoff.caller("k", "t", "m", "/v1/chat/completions", True, True, True, True,
                           False, weights=weights)}
    return handoff.read(orjson.loads(orjson.dumps(md)))  # as the record's JSON carries it


def test_the_weights_reach_metering_through_the_metadata() -> None:
    assert _facts(W).weights == W
    assert _facts(None).weights is None
    assert handoff.read({"key_id": "k", "token_weights": "garbled"}).weights is None


def test_checkpoints_carry_the_weighted_count_only_for_a_weighted_model() -> None:
    reported = ResponseFacts(status=200, usage=usage(100, 7, cached=40, created=8))
    assert billing.checkpoint(_facts(None), reported) == (100, 7)  # the format of before
    assert billing.checkpoint(_facts(W), reported) == (100, 7, 94, 40, 8)  # + its cache
    meter = Meter("/v1/chat/completions", True, prompt_estimate=100, weights=W)
    meter.response_headers(200, "text/event-stream")
    meter.chunk(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n', False)
    assert meter.checkpoint() == (100, 1, 104)  # estimated so far: 100 + 4 x 1
    meter.weights = None
    assert meter.checkpoint() == (100, 1)


class _Ledger:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []

    def released(self, request_id: str) -> None:
        pass

    def settled(self, request_id: str, tokens: int | None) -> None:
        self.calls.append((request_id, tokens))


async def test_the_settlement_is_weighted_and_the_event_raw(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "i").open()
    ledger = _Ledger()
    fake: Any = ledger
    recorder = Recorder(spool, "s", fake)
    calls = ledger.calls
    writer = asyncio.create_task(spool.run_writer())
    try:
        done = ResponseFacts(status=200, ended=True, usage=usage(100, 7, cached=40, created=8))
        weighted = recorder.finish(_facts(W), done, 0.0)
        plain = recorder.finish(_facts(None), done, 0.0)
        for _ in range(200):
            if len(calls) == 2:
                break
            await asyncio.sleep(0.01)
    finally:
        writer.cancel()
    assert calls == [("r1", 94), ("r1", 107)]
    assert weighted.usage == plain.usage == usage(100, 7, cached=40, created=8)  # raw
    lines = [orjson.dumps({"event_id": "a", "outcome": "completed", "model": "m",
                           "ended_at": "2027-01-15T08:00:00Z",
                           "usage": {"prompt_tokens": "100", "completion_tokens": "7",
                                     "total_tokens": "107", "cached_tokens": "40",
                                     "cache_creation_tokens": "8"}})]
    assert list(settlements(lines, 0.0)) == [("a", 107)]  # a restart's re-settlement
    assert list(settlements(lines, 0.0, {"m": W}.get)) == [("a", 94)]


def test_an_orphan_is_billed_its_raw_checkpoint() -> None:
    b = billing.orphaned(_facts(W), (100, 7), charged=94)
    assert (b.usage.prompt_tokens, b.usage.completion_tokens, b.source) == (100, 7,
                                                                           "checkpoint")


# --- keys show ------------------------------------------------------------------------------

async def test_keys_show_says_when_the_token_windows_are_weighted() -> None:
    p = _policy()
    rows = await keys_show.standings(keys_show.key_tiers(p, "alice"), None, 0.0)
    data = keys_show.as_data(p, "alice", rows, 0.0, counters=False)
    assert data["token_weights"] == {"qwen3-coder": {
        "input": 1.0, "cached_input": 0.1, "cache_creation": 1.25, "output": 4.0}}
    text = keys_show.table(data)
    assert ("weighted tokens: the token windows count the weighted tokens of requests for "
            "qwen3-coder (input 1, cached_input 0.1, cache_creation 1.25, output 4)") in text
    plain = keys_show.as_data(_policy("{}"), "alice", rows, 0.0, counters=False)
    assert plain["token_weights"] == {} and "weighted" not in keys_show.table(plain)
    assert SECRETS  # (the engine tests' keys)


def test_a_zero_limit_message_is_unchanged_by_weights() -> None:
    d = answers.limit_denial(Refused("key", "tokens_per_day", 0, 3600), 50, 5, W, 10)
    assert "never pass" in d.message and "weighted" not in d.message


# --- the hub's allocator ----------------------------------------------------------------------

def test_the_allocator_counts_a_weighted_models_events_as_its_spokes_do() -> None:
    """A spoke charges its global quota a weighted model's limit tokens: the allocator's
    ledger counts that model's events so too (the others' at their total)."""
    doc = {"revision": 3, "policy": {
        "models": {"m": {"token_weights": {"cached_input": 0.1, "cache_creation": 1.25,
                                           "output": 4}}, "plain": {}},
        "teams": {"g": {"models": ["*"], "global_limits": {"tokens_per_day": 1000}}}}}
    ledger = QuotaLedger()
    ledger.on_policy("*", doc)
    ts = 1_800_000_000.0
    for eid, model in (("e1", "m"), ("e2", "plain")):
        ledger.on_usage({"event_id": eid, "spoke": "a", "team": "g", "key_id": "k",
                         "model": model, "started_at": rfc3339(ts), "usage": {
                             "prompt_tokens": "100", "completion_tokens": "7",
                             "total_tokens": "107", "cached_tokens": "40",
                             "cache_creation_tokens": "8"}})
    cell = ("team:g", "day", maths.day_id(ts))
    assert ledger.use("a", cell, 1000).used == 94 + 107
