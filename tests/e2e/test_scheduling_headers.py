"""The policy's InferenceObjective reaches the engine through real Envoy, through each of the
Check's doors (HTTP and gRPC): x-gateway-inference-objective when the key (or else its team)
names one, never the client's own; x-gateway-inference-fairness-id, the key's team, always;
a policy push changes them for the next requests."""

from __future__ import annotations

import asyncio
import secrets as random
import time
from typing import Any

import httpx
import orjson
import pytest

from devspoke.publish import policy_backend
from devspoke.stack import Spoke
from gateway.cli import main
from gateway.policy.loader import parse_doc, to_data

# the headers are the Check's, but metering's filters (the Lua filter, ext_proc) sit on the
# same request path: every source, and the default one through the gRPC Check too
ALSO_GRPC_CHECK = True

OBJ, FAIR = "x-gateway-inference-objective", "x-gateway-inference-fairness-id"
FORGED = {OBJ: "critical", FAIR: "someone-else", "x-gateway-model": "gpt-free"}


def _ask(spoke: Spoke, secret: str, path: str = "/v1/chat/completions",
         body: dict[str, Any] | None = None) -> dict[str, str]:
    """One allowed request with forged scheduling headers: the headers the engine saw."""
    httpx.post(f"{spoke.engine_url}/mock/reset")
    r = httpx.post(f"http://127.0.0.1:{spoke.listen_port}{path}", timeout=30,
                   headers={"authorization": f"Bearer {secret}", **FORGED},
                   json=body if body is not None else {
                       "model": "mock-model", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    seen: dict[str, str] = httpx.get(f"{spoke.engine_url}/mock/stats").json()[
        "last_headers"][-1]
    return seen


def _until(spoke: Spoke, secret: str, objective: str | None, timeout: float = 10
           ) -> dict[str, str]:
    """The engine's headers once the new revision reached the sidecar (a moment after the
    push): the first request whose objective is `objective` (None: none)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = _ask(spoke, secret)
        except AssertionError:  # a key the sidecar does not know yet: 401
            seen = {}
        if (seen and seen.get(OBJ) == objective) or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, str]:
    assert main(list(argv)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in out.splitlines()
                                              if ":" in ln)}


def _add_team(spoke: Spoke, team: str, objective: str) -> None:
    """A team with an objective, pushed as the next revision (everything else kept)."""
    async def go() -> None:
        async with policy_backend(spoke.redis_url) as backend:
            rev, doc = await backend.read()
            data = to_data(doc)
            data["teams"][team] = {"models": ["mock-*"], "inference_objective": objective}
            await backend.write(parse_doc(orjson.dumps(data)), rev)
    asyncio.run(go())


def test_a_keys_objective_and_its_team_reach_the_engine_never_the_clients(
        spoke: Spoke, keys: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    key_id = f"sched_{random.token_hex(4)}"
    store = ("--redis-url", spoke.redis_url)
    secret = _cli(capsys, "keys", "create", "--team", "t1", "--key-id", key_id,
                  "--inference-objective", "premium", *store)["secret"]
    seen = _until(spoke, secret, "premium")
    assert (seen.get(OBJ), seen.get(FAIR)) == ("premium", "t1"), seen
    assert seen["x-gateway-model"] == "mock-model" and seen["x-gateway-key-id"] == key_id

    # a key without one: the engine sees none, though the client sent one
    plain = _ask(spoke, keys["good"])
    assert OBJ not in plain and plain[FAIR] == "t1", plain

    # a policy push changes it for the next requests; dropping it leaves none
    _cli(capsys, "keys", "update", key_id, "--inference-objective", "batch", *store)
    assert _until(spoke, secret, "batch").get(OBJ) == "batch"
    _cli(capsys, "keys", "update", key_id, "--no-inference-objective", *store)
    dropped = _until(spoke, secret, None)
    assert OBJ not in dropped and dropped.get(FAIR) == "t1", dropped


def test_a_teams_objective_applies_unless_the_key_names_its_own(
        spoke: Spoke, capsys: pytest.CaptureFixture[str]) -> None:
    team = f"sched-{random.token_hex(4)}"
    _add_team(spoke, team, "team-tier")
    store = ("--redis-url", spoke.redis_url)
    inherits = _cli(capsys, "keys", "create", "--team", team, *store)["secret"]
    own = _cli(capsys, "keys", "create", "--team", team, "--inference-objective", "key-tier",
               *store)["secret"]
    seen = _until(spoke, inherits, "team-tier")
    assert (seen.get(OBJ), seen.get(FAIR)) == ("team-tier", team), seen
    seen = _until(spoke, own, "key-tier")
    assert (seen.get(OBJ), seen.get(FAIR)) == ("key-tier", team), seen


def test_a_passthrough_request_without_a_model_gets_no_model_header(
        spoke: Spoke, keys: dict[str, str]) -> None:
    seen = _ask(spoke, keys["good"], "/tokenize", {"prompt": "hi"})
    assert "x-gateway-model" not in seen, seen  # neither empty nor the client's
    assert OBJ not in seen and seen[FAIR] == "t1" and seen["x-gateway-team"] == "t1"
