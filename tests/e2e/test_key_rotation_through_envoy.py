"""`gateway keys rotate` through real Envoy and the sidecar: within the grace both secrets
are the same key (one token budget, one key id in the events); after it the old one is 401
and the new one carries on. Through each of the Check's doors (HTTP and gRPC)."""

from __future__ import annotations

import secrets as random
import time
from datetime import datetime

import httpx
import pytest

from devspoke.stack import Spoke
from gateway.cli import main
from testkit.spoke import read_events

AUTHZ_ONLY = True  # decided by the Check; the reservation counts whatever meters it after

GRACE_S = 8  # room for the revision to reach the sidecar on a loaded machine


def _ask(spoke: Spoke, secret: str, max_tokens: int = 1) -> httpx.Response:
    return httpx.post(f"{spoke.base_url}/chat/completions",
                      headers={"authorization": f"Bearer {secret}"},
                      json={"model": "mock-model", "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "hello there"}]},
                      timeout=30)


def _until(spoke: Spoke, secret: str, status: int, timeout: float) -> httpx.Response:
    """The first answer with `status` (the new revision takes a moment to reach the sidecar)."""
    deadline = time.monotonic() + timeout
    while True:
        r = _ask(spoke, secret)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, str]:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in out.splitlines())}


def test_a_rotated_key_keeps_its_budget_and_its_old_secret_until_the_grace_ends(
        spoke: Spoke, capsys: pytest.CaptureFixture[str]) -> None:
    key_id = f"rot_{random.token_hex(4)}"
    store = ("--redis-url", spoke.redis_url)
    old = _cli(capsys, "keys", "create", "--team", "t1", "--key-id", key_id,
               "--tokens-per-day", "400", *store)["secret"]
    first = _until(spoke, old, 200, 5)
    assert first.status_code == 200, first.text
    spent = _ask(spoke, old, max_tokens=300)  # most of the day's 400 tokens, by the old secret
    assert spent.status_code == 200, spent.text

    rotated = _cli(capsys, "keys", "rotate", key_id, "--grace", f"{GRACE_S}s", *store)
    new = rotated["secret"]
    until = datetime.fromisoformat(rotated["previous"].removeprefix("valid until ")).timestamp()
    in_grace = [_until(spoke, new, 200, 6), _ask(spoke, old)]
    assert time.time() < until  # both answered within the grace
    assert [r.status_code for r in in_grace] == [200, 200], [r.text for r in in_grace]

    # the budget the old secret spent is the key's: the new secret has only the rest
    over = _ask(spoke, new, max_tokens=150)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "insufficient_quota"
    assert over.headers["x-gateway-limit-tier"] == "key"

    time.sleep(max(0.0, until - time.time()))  # polling meanwhile would spend the budget
    ended = _until(spoke, old, 401, 2)
    assert ended.status_code == 401, ended.text
    later = _ask(spoke, new)
    assert later.status_code == 200, later.text

    answered = [first, spent, *in_grace, over, ended, later]
    ids = {r.headers["x-request-id"] for r in answered}
    events = read_events(spoke.kafka_bootstrap, ids, timeout=30)
    assert {e["event_id"] for e in events} == ids
    assert {e["key_id"] for e in events} == {key_id}  # both secrets: one key
    by_id = {e["event_id"]: e for e in events}
    assert [by_id[r.headers["x-request-id"]]["status_code"] for r in answered] == [
        200, 200, 200, 200, 429, 401, 200]
