"""An invoiceable report through the real spoke, on both metering sources: each event's
cost at the model's price, denials that say whether they were streams and claim no usage
source, `GET /v1/models` not counted as a billed request; and `keys show`, live use from
the limiter's counters."""

from __future__ import annotations

import secrets as pysecrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from devspoke.stack import Spoke
from gateway.cli import main
from gateway.policy import secrets
from testkit.spoke import client, policy_doc, publish, read_events

MSG = [{"role": "user", "content": "count these five words"}]
DAY = 10**6
PRICE = {"effective": "2020-01-01T00:00:00Z", "input": 2.0, "cached_input": 0.5,
         "output": 6.0}


@pytest.fixture
def priced(spoke: Spoke, keys: dict[str, str]) -> Iterator[tuple[str, str]]:
    """A fresh key (narrowed to mock-model) in a revision that prices mock-model; the test
    policy is restored afterwards."""
    key_id = f"bill_{pysecrets.token_hex(4)}"
    secret = secrets.new_secret(key_id)
    doc = policy_doc(keys)
    doc["models"]["mock-model"] = {"prices": [PRICE]}
    doc["keys"][key_id] = {"team": "t1", "sha256": secrets.digest(secret).hex(),
                           "models": ["mock-model"],
                           "limits": {"concurrency": 8, "tokens_per_day": DAY}}
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


def _rid(raw: Any) -> str:
    return str(raw.headers["x-request-id"])


def test_events_carry_their_cost_and_the_report_bills_them(
        spoke: Spoke, priced: tuple[str, str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    key_id, secret = priced
    c = client(spoke, secret)
    chat = c.chat.completions.with_raw_response
    rids = {"plain": _rid(chat.create(model="mock-model", messages=MSG, max_tokens=5))}
    raw = chat.create(model="mock-model", messages=MSG, max_tokens=6, stream=True)
    list(raw.parse())
    rids["stream"] = _rid(raw)
    listing = httpx.get(f"{spoke.base_url}/models", headers={"authorization": f"Bearer {secret}"})
    rids["models"] = listing.headers["x-request-id"]
    with pytest.raises(openai.PermissionDeniedError) as info:  # the key is narrowed
        chat.create(model="mock-other", messages=MSG, max_tokens=5, stream=True)
    rids["denied"] = info.value.response.headers["x-request-id"]

    by_id = {e["event_id"]: e for e in read_events(spoke.kafka_bootstrap, set(rids.values()))}
    for name in ("plain", "stream"):
        e = by_id[rids[name]]
        u = {k: int(v) for k, v in e["usage"].items()}
        assert u["prompt_tokens"] > 0 and u["completion_tokens"] > 0, name
        assert e["cost"] == pytest.approx(
            ((u["prompt_tokens"] - u["cached_tokens"]) * 2 + u["cached_tokens"] * 0.5
             + u["completion_tokens"] * 6) / 1e6), name
        assert e["price_effective"] == "2020-01-01T00:00:00.000Z", name
    denied = by_id[rids["denied"]]
    assert (denied["outcome"], denied["status_code"], denied["stream"]) == ("denied", 403, True)
    assert (denied["usage_source"], denied["cost"]) == ("", 0)
    assert by_id[rids["models"]]["cost"] == 0

    db = f"sqlite:///{tmp_path / 'usage.db'}"
    assert main(["usage", "consume", "--kafka", spoke.kafka_bootstrap, "--db", db,
                 "--group", f"g-{key_id}", "--until-caught-up"]) == 0
    capsys.readouterr()
    assert main(["usage", "report", "--db", db, "--by", "key,model", "--per", "day",
                 "-o", "json"]) == 0
    rows = [r for r in orjson.loads(capsys.readouterr().out)["rows"] if r["key"] == key_id]
    by_model = {r["model"]: r for r in rows}
    assert (by_model["mock-model"]["completed"], by_model["mock-model"]["not_billed"]) == (2, 0)
    assert by_model["mock-model"]["cost"] == pytest.approx(
        by_id[rids["plain"]]["cost"] + by_id[rids["stream"]]["cost"])
    # GET /v1/models (ours, and the fixture's wait for the revision): none is a billed request
    assert by_model[""]["not_billed"] >= 1 and by_model[""]["completed"] == 0
    assert by_model["mock-other"]["denied"] == 1


def test_keys_show_reads_what_is_used_and_left_from_the_limiters_counters(
        spoke: Spoke, priced: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    key_id, secret = priced
    chat = client(spoke, secret).chat.completions.with_raw_response
    rids = {_rid(chat.create(model="mock-model", messages=MSG, max_tokens=n)) for n in (3, 5)}
    billed = sum(int(e["usage"]["total_tokens"])
                 for e in read_events(spoke.kafka_bootstrap, rids))
    r = redis.Redis.from_url(spoke.redis_url)
    deadline = time.monotonic() + 10  # settled: each reservation replaced by its count
    while any(r.exists(f"gw:req:{rid}") for rid in rids):
        assert time.monotonic() < deadline, "the admissions were not settled"
        time.sleep(0.02)

    assert main(["keys", "show", key_id, "--redis-url", spoke.redis_url, "-o", "json"]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert (shown["key_id"], shown["state"], shown["counters"]) == (key_id, "active", True)
    tiers = {t["tier"]: {w["limit"]: w for w in t["windows"]} for t in shown["tiers"]}
    day = tiers["key"]["tokens_per_day"]
    assert (day["allowed"], day["used"], day["left"]) == (DAY, billed, DAY - billed)
    assert (tiers["key"]["concurrency"]["used"], tiers["key"]["concurrency"]["left"]) == (0, 8)
    assert set(tiers) == {"key"}  # t1 and mock-model name no limits in the test policy

    assert main(["keys", "show", key_id, "--redis-url", spoke.redis_url]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["key", key_id, "tokens_per_day", str(DAY), str(billed), str(DAY - billed)] in \
        [row[:6] for row in rows]
    assert main(["keys", "show", "no_such_key", "--redis-url", spoke.redis_url]) == 2


def test_a_streams_usage_counts_against_its_token_limit_and_remaining_falls_by_it(
        spoke: Spoke, priced: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """Streams whose client never asked for usage are charged what the engine reported, in
    the limiter's windows, and the next answer's remaining tokens fall by exactly that (peers:
    LiteLLM #41610, streaming TPM never enforced; ai-gateway #1754, remaining never falls)."""
    key_id, secret = priced
    chat = client(spoke, secret).chat.completions.with_raw_response
    r = redis.Redis.from_url(spoke.redis_url)
    rids, remaining = [], []
    for _ in range(3):  # the same body each time: the same reservation
        raw = chat.create(model="mock-model", messages=MSG, max_tokens=7, stream=True)
        chunks = list(raw.parse())
        assert all(c.usage is None for c in chunks)  # the client did not ask for usage
        rids.append(_rid(raw))
        remaining.append(int(raw.headers["x-ratelimit-remaining-tokens"]))
        deadline = time.monotonic() + 10  # settled: its reservation replaced by its count
        while r.exists(f"gw:req:{rids[-1]}"):
            assert time.monotonic() < deadline, "the admission was not settled"
            time.sleep(0.02)
    by_id = {e["event_id"]: e for e in read_events(spoke.kafka_bootstrap, set(rids))}
    billed = [int(by_id[rid]["usage"]["total_tokens"]) for rid in rids]
    assert all(by_id[rid]["usage_source"] == "reported" for rid in rids)
    assert all(b > 0 for b in billed)
    reserved = DAY - remaining[0]  # a fresh key: the first answer's remaining less its own
    assert reserved != billed[0]  # so what follows tells the bill from the reservation
    # each answer's remaining counts the stream before it at its billed size
    assert remaining[0] - remaining[1] == billed[0]
    assert remaining[1] - remaining[2] == billed[1]
    assert main(["keys", "show", key_id, "--redis-url", spoke.redis_url, "-o", "json"]) == 0
    [key] = [t for t in orjson.loads(capsys.readouterr().out)["tiers"] if t["tier"] == "key"]
    day = {w["limit"]: w for w in key["windows"]}["tokens_per_day"]
    assert day["used"] == sum(billed)  # the day's window holds the three streams' counts
