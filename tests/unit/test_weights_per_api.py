"""Token weights by API, on both metering sources: what each API's usage counts toward the
token limits (docs/policy.md "Weighted tokens").

Every answer of tests/unit/test_metering_parity.py's corpus goes through ext_proc's Meter and
through Envoy's Lua filter / json_to_metadata and record, with the Check's metadata naming the
model's weights; both must settle, and checkpoint, the same limit tokens, and for each API
those are worked out here by hand from its token types:

* chat/completions and the Responses API: the prompt (input_tokens) includes its cached
  tokens, so uncached = prompt - cached;
* Anthropic Messages: input_tokens leaves out cache_read_input_tokens and
  cache_creation_input_tokens, which add to it;
* embeddings: the prompt only; an engine without prefix-cache stats: nothing cached.

And an orphan (its sidecar died mid-stream) is billed an event the hub's quota ledger and a
restart's re-settlement count as the sweep charged it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import orjson
import pytest
import test_metering_parity as parity
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.hub.quota_ledger import QuotaLedger
from gateway.limits import memory, redis_store
from gateway.metering import billing
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.token_weights import TokenWeights, limit_tokens
from gateway.usage_event import Usage

W = TokenWeights(input=1, cached_input=0.1, cache_creation=1.25, output=4)


@pytest.fixture(autouse=True)
def _weighted_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Check's metadata names the weights, as it does for a weighted model."""
    plain = parity.authz
    monkeypatch.setattr(parity, "authz", lambda case: {**plain(case), "token_weights": W.text()})


def _both(case: parity.Case, size: int | None = None
          ) -> tuple[tuple[RequestFacts, ResponseFacts], tuple[RequestFacts, ResponseFacts]]:
    chunks = parity.pieces(case, size)
    x_req, x_resp = parity.via_ext_proc(case, chunks)
    e_req, e_resp = parity.via_envoy(case, chunks)
    assert x_req.weights == e_req.weights == W
    return (x_req, parity.timeless(x_resp)), (e_req, parity.timeless(e_resp))


@pytest.mark.parametrize("size", [None, 3], ids=["by-event", "3-byte-chunks"])
@pytest.mark.parametrize("case", parity.CASES, ids=[c.name for c in parity.CASES])
def test_both_sources_settle_and_checkpoint_the_same_limit_tokens(
        case: parity.Case, size: int | None) -> None:
    (x_req, x_resp), (e_req, e_resp) = _both(case, size)
    x_bill, e_bill = billing.settle(x_req, x_resp), billing.settle(e_req, e_resp)
    assert limit_tokens(x_bill.usage, W) == limit_tokens(e_bill.usage, W)
    assert billing.checkpoint(x_req, x_resp) == billing.checkpoint(e_req, e_resp)


# (case, (prompt, cached, created, completion) as billed, the limit tokens by hand)
BY_HAND = [
    # chat: 11 prompt of which 4 cached: 7 x 1 + 4 x 0.1 + 5 x 4 = 27.4
    ("chat, usage injected and hidden", (11, 4, 0, 5), 28),
    ("chat, the client asked for usage", (11, 4, 0, 5), 28),
    # two choices' usage-only chunks (llama.cpp), summed: 2 + 1.2 + 8 = 11.2
    ("chat, n=2, one usage chunk per choice (llama.cpp)", (14, 12, 0, 2), 12),
    # vLLM without prefix-caching stats: no details, nothing cached: 8 + 16
    ("chat, n=2, one usage chunk for both (vLLM)", (8, 0, 0, 4), 24),
    ("chat, whole JSON", (9, 1, 0, 2), 17),  # 8 + 0.1 + 8
    ("chat, counts written as floats (12.0)", (12, 4, 0, 3), 21),  # 8 + 0.4 + 12
    ("completions, whole JSON, n=2", (3, 0, 0, 8), 35),
    # Responses: input 9 of which 3 cached, output 6 (reasoning included): 6 + 0.3 + 24
    ("responses, whole", (9, 3, 0, 6), 31),
    ("responses, whole JSON", (9, 3, 0, 6), 31),
    # Anthropic: input 5 + cache read 2 + cache written 3: 5 + 0.2 + 3.75 + 48 = 56.95
    ("messages, whole", (10, 2, 3, 12), 57),
    ("messages, message_delta's input side null", (10, 2, 3, 12), 57),
    # a cumulative message_delta: input 7, read 2, written 3, output 40: 7 + 0.2 + 3.75 + 160
    ("messages, today's API: server tools, nested cache counts, a cumulative delta",
     (12, 2, 3, 40), 171),
    # whole JSON: input 4, read 10, written 2, output 7: 4 + 1 + 2.5 + 28 = 35.5
    ("messages, whole JSON with cache counts", (16, 10, 2, 7), 36),
    # cut after message_start: the input side exact, the output estimated (7)
    ("messages, cut by the engine after message_start", (10, 2, 3, 7), 37),
    ("embeddings", (6, 0, 0, 0), 6),
]


@pytest.mark.parametrize(("name", "kinds", "tokens"), BY_HAND, ids=[b[0] for b in BY_HAND])
def test_each_apis_token_types_count_as_the_api_means_them(
        name: str, kinds: tuple[int, int, int, int], tokens: int) -> None:
    case = next(c for c in parity.CASES if c.name == name)
    for req, resp in _both(case):
        u = billing.settle(req, resp).usage
        assert (u.prompt_tokens, u.cached_tokens, u.cache_creation_tokens,
                u.completion_tokens) == kinds
        assert limit_tokens(u, W) == tokens


def test_a_cut_anthropic_streams_checkpoint_keeps_its_cache_counts() -> None:
    """message_start's input side is exact: the checkpoint weighs its cache counts."""
    case = next(c for c in parity.CASES
                if c.name == "messages, cut by the engine after message_start")
    for req, resp in _both(case):
        ck = billing.checkpoint(req, resp)
        assert ck is not None and ck[:3] == (10, 7, 37)


# --- an orphan: what the sweep charged is what its event counts ---------------------------

def _orphan_event(usage: Usage) -> dict[str, Any]:
    return {"spoke": "s1", "event_id": "e1", "team": "t", "key_id": "k", "model": "m",
            "started_at": "2027-01-15T08:00:00Z",
            "usage": {"prompt_tokens": str(usage.prompt_tokens),
                      "completion_tokens": str(usage.completion_tokens),
                      "total_tokens": str(usage.total_tokens),
                      "cached_tokens": str(usage.cached_tokens),
                      "cache_creation_tokens": str(usage.cache_creation_tokens)}}


async def test_an_orphans_event_counts_what_the_sweep_charged() -> None:
    """A weighted stream whose sidecar died after Anthropic's message_start: the sweep
    charges its checkpoint's limit tokens (the cache counts weighed); its event must carry
    those cache counts, else the hub's quota ledger (and the prices) count its cached
    tokens as uncached."""
    case = next(c for c in parity.CASES
                if c.name == "messages, cut by the engine after message_start")
    (req, resp), _ = _both(case)
    ck = billing.checkpoint(req, resp)
    assert ck is not None
    store = memory.MemoryLimiter()
    store.held["r1"] = memory._Held([], [], reserved=50, until=0.0, checkpoint=ck)
    [orphan] = await store.sweep(1.0)
    assert orphan.charged == 37
    billed = billing.orphaned(req, orphan.checkpoint, orphan.charged, orphan.cache)
    u = billed.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens,
            u.cache_creation_tokens) == (10, 7, 2, 3)
    assert limit_tokens(u, W) == orphan.charged
    hub = QuotaLedger()
    hub._weights["*"] = {"m": W}
    hub.on_usage(_orphan_event(u))
    assert set(hub._used.values()) == {orphan.charged}


def test_the_stored_checkpoint_reads_back_with_its_cache_counts() -> None:
    """renew.lua stores the checkpoint as "p:c[:w]" (`u`, the format every sidecar's sweep
    reads) and a weighted one's cache counts as "cached:created" (`k`); the sweep reads
    them back."""
    assert redis_store._renewal((10, 7, 37, 2, 3)) == "10:7:37\x1f2:3"
    assert redis_store._renewal((10, 7, 37)) == "10:7:37\x1f0:0"
    assert redis_store._renewal((10, 7)) == "10:7"  # no `k`: the record of before
    assert redis_store._checkpoint("10:7:37") == (10, 7)
    assert redis_store._checkpoint("10:7") == (10, 7)
    assert redis_store._checkpoint("10:7:37:2:3") is None  # never `u`'s format
    assert redis_store._cache("2:3") == (2, 3)
    assert redis_store._cache("0:0") == (0, 0)
    assert redis_store._cache("") == (0, 0)  # an older sidecar's record: no `k`
    assert billing.progress(Usage(10, 7, 17, 2, 0, 3), W) == (10, 7, 37, 2, 3)
    assert billing.progress(Usage(10, 7, 17), W) == (10, 7, 38)  # the format of before
    assert billing.progress(Usage(10, 7, 17, 2, 0, 3), None) == (10, 7)


# --- any counts, each API: both sources, the docs' formula in exact fractions -------------

def _exact(prompt: int, cached: int, created: int, completion: int) -> int:
    """docs/policy.md's formula in fractions (not the gateway's floats)."""
    w = [Fraction(str(x)) for x in (W.input, W.cached_input, W.cache_creation, W.output)]
    return math.ceil(w[0] * max(0, prompt - cached - created) + w[1] * cached
                     + w[2] * created + w[3] * completion)


def _api_case(api: str, inp: int, read: int, made: int, out: int) -> parity.Case:
    """One answer of `api` reporting these counts, as that API means them: `inp` the
    uncached input (OpenAI's prompt then counts `inp + read`; Anthropic's input_tokens is
    `inp` and the cache counts add to it)."""
    if api == "chat":
        u = {"prompt_tokens": inp + read, "completion_tokens": out,
             "total_tokens": inp + read + out, "prompt_tokens_details": {"cached_tokens": read}}
        return parity.Case(api, parity.CHAT, [parity.chat("a", u=None), parity.usage_only(u),
                                              parity.DONE], "completed", "reported")
    if api == "responses":
        done = {"type": "response.completed", "response": {"id": "r", "model": "m", "usage": {
            "input_tokens": inp + read, "input_tokens_details": {"cached_tokens": read},
            "output_tokens": out, "total_tokens": inp + read + out}}}
        return parity.Case(api, parity.RESPONSES, [parity.named("response.completed", done)],
                           "completed", "reported")
    usage = {"input_tokens": inp, "cache_read_input_tokens": read,
             "cache_creation_input_tokens": made}
    if api == "messages-json":
        return parity.Case(api, parity.MESSAGES, [orjson.dumps({
            "id": "m", "type": "message", "model": "m", "content": [],
            "usage": {**usage, "output_tokens": out}})], "completed", "reported",
            content_type=parity.JSON)
    return parity.Case(api, parity.MESSAGES, [
        parity.named("message_start", {"type": "message_start", "message": {
            "id": "m", "model": "m", "usage": {**usage, "output_tokens": 1}}}),
        parity.named("message_delta", {"type": "message_delta", "delta": {}, "usage": (
            {**usage, "output_tokens": out} if api == "messages-cumulative"
            else {"output_tokens": out})}),
        parity.named("message_stop", {"type": "message_stop"})], "completed", "reported")


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["chat", "responses", "messages", "messages-cumulative",
                        "messages-json"]),
       st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6),
       st.integers(0, 10**5))
def test_any_counts_weigh_alike_on_both_sources(api: str, inp: int, read: int, made: int,
                                                out: int) -> None:
    made = made if api.startswith("messages") else 0  # OpenAI's APIs have no cache writes
    case = _api_case(api, inp, read, made, out)
    chunks = parity.pieces(case, None)
    x_req, x_resp = parity.via_ext_proc(case, chunks)  # weighted: the autouse fixture
    e_req, e_resp = parity.via_envoy(case, chunks)
    assert x_req.weights == e_req.weights == W
    for req, resp in ((x_req, x_resp), (e_req, e_resp)):
        u = billing.settle(req, parity.timeless(resp)).usage
        assert (u.prompt_tokens, u.cached_tokens, u.cache_creation_tokens,
                u.completion_tokens) == (inp + read + made, read, made, out)
        assert limit_tokens(u, W) == _exact(inp + read + made, read, made, out)


def test_an_engine_reporting_more_cached_than_prompt_tokens_weighs_alike_on_both() -> None:
    """The uncached part is never below 0 (tests/unit/test_token_weights.py), on either
    source: 30 cached of a 10-token prompt count 0.1 x 30, nothing negative."""
    u = {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 30}}
    case = parity.Case("quirk", parity.CHAT, [parity.chat("a", u=None), parity.usage_only(u),
                                              parity.DONE], "completed", "reported")
    for req, resp in _both(case):
        assert limit_tokens(billing.settle(req, resp).usage, W) == 3
