"""The Gateway API Inference Extension's scheduling headers on an allowed request, through
both Check doors: the key's InferenceObjective (x-gateway-inference-objective, when it has
one) and its team as the fairness id; a context header the gateway does not set on a
request (no objective, no model) is removed, never left with the client's value."""

from __future__ import annotations

import json

import pytest

from gateway import envoy_contract as contract
from gateway.authz import answers
from gateway.authz.check import Allowed, answer
from gateway.authz.decision import Allow, Caller, Callers, Context
from gateway.authz.engine import AdmissionSettings, Authorizer
from gateway.authz.request import AuthzRequest
from gateway.clock import FakeClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.limits.types import RateInfo
from gateway.policy import secrets
from gateway.policy.loader import load
from gateway.policy.model import Policy
from gateway.server import check_grpc, check_http
from tests.unit.test_check import via_grpc, via_http

OBJ, FAIR, MODEL = contract.OBJECTIVE_HEADER, contract.FAIRNESS_ID_HEADER, contract.MODEL_HEADER
FORGED = {"authorization": "Bearer sk", OBJ: "critical", FAIR: "someone-else",
          MODEL: "gpt-free", contract.TEAM_HEADER: "evil", "x-gateway-extra": "1"}


def test_a_caller_with_an_objective_names_it_and_its_team_as_the_fairness_id() -> None:
    caller = Caller("k1", "team-a", "m", objective="premium")
    assert dict(caller.upstream) == {contract.KEY_ID_HEADER: "k1",
                                     contract.TEAM_HEADER: "team-a", MODEL: "m",
                                     OBJ: "premium", FAIR: "team-a"}
    assert caller.keeps == {contract.REQUEST_ID_HEADER, *dict(caller.upstream)}


def test_a_caller_sets_no_objective_without_one_and_no_model_without_one() -> None:
    caller = Caller("k1", "team-a", "")
    assert dict(caller.upstream) == {contract.KEY_ID_HEADER: "k1",
                                     contract.TEAM_HEADER: "team-a", FAIR: "team-a"}
    assert OBJ not in caller.keeps and MODEL not in caller.keeps


def test_the_callers_cache_takes_a_new_revisions_objective() -> None:
    callers = Callers()
    first = callers.get(1, "k1", "team-a", "m", "generated", "batch")
    assert callers.get(1, "k1", "team-a", "m", "generated", "batch") is first
    assert dict(first.upstream)[OBJ] == "batch"
    moved = callers.get(2, "k1", "team-a", "m", "generated", "premium")
    assert dict(moved.upstream)[OBJ] == "premium"
    dropped = callers.get(3, "k1", "team-a", "m", "generated", "")
    assert OBJ not in dict(dropped.upstream)


@pytest.mark.parametrize("objective, model, removed", [
    ("premium", "m", ["x-gateway-extra"]),
    ("", "m", [OBJ, "x-gateway-extra"]),  # its key names none: the client's goes
    ("premium", "", [MODEL, "x-gateway-extra"]),  # no model (a pass-through): none kept
    ("", "", [OBJ, MODEL, "x-gateway-extra"]),
])
def test_removed_headers_drop_every_context_header_the_caller_does_not_set(
        objective: str, model: str, removed: list[str]) -> None:
    caller = Caller("k1", "team-a", model, objective=objective)
    assert answers.removed_headers(FORGED, caller.keeps) == [*contract.CREDENTIALS, *removed]


def _allowed(caller: Caller) -> Allowed:
    allow = Allow(Context("r1", caller, False, 10, True, "/v1/chat/completions"),
                  RateInfo())
    a = answer(allow, AuthzRequest("r1", "POST", "/v1/chat/completions", FORGED, b"{}"))
    assert isinstance(a, Allowed)
    return a


@pytest.mark.parametrize("objective, model", [("premium", "m"), ("", "m"), ("premium", ""),
                                              ("", "")])
def test_both_doors_set_ours_and_remove_the_unset_ones(objective: str, model: str) -> None:
    a = _allowed(Caller("k1", "team-a", model, objective=objective))
    for _ in range(2):  # the caller's part encoded, then as remembered
        for status, headers, _, _ in (via_grpc(a), via_http(a)):
            assert status == 200
            removed = headers[contract.REMOVE_HEADER].split(",")
            assert headers[FAIR] == "team-a" and FAIR not in removed
            assert headers[contract.TEAM_HEADER] == "team-a"
            if objective:
                assert headers[OBJ] == objective and OBJ not in removed
            else:
                assert OBJ not in headers and OBJ in removed
            if model:
                assert headers[MODEL] == model and MODEL not in removed
            else:  # no empty x-gateway-model, and the client's is removed
                assert MODEL not in headers and MODEL in removed


def test_the_encoders_write_the_same_bytes_for_the_same_caller() -> None:
    caller = Caller("k1", "team-a", "m", objective="premium")
    a, b = _allowed(caller), _allowed(caller)
    assert check_grpc.serialize(check_grpc.encode(a)) == check_grpc.serialize(
        check_grpc.encode(b))
    assert check_http.encode(a) == check_http.encode(b)


# --- through the Authorizer: the policy's objective reaches the Caller ---------------------

SECRETS = {k: f"sk-gw-{k}-{k * 8}" for k in ("own", "inherits", "plain")}


def policy(revision: int, key_objective: str | None) -> Policy:
    key: dict[str, object] = {"team": "t", "sha256": secrets.digest(SECRETS["own"]).hex()}
    if key_objective is not None:
        key["inference_objective"] = key_objective
    return load(json.dumps({
        "models": {"m": {}},
        "teams": {"t": {"models": ["*"], "inference_objective": "batch"},
                  "u": {"models": ["*"]}},
        "keys": {"own": key,
                 "inherits": {"team": "t", "sha256": secrets.digest(SECRETS["inherits"]).hex()},
                 "plain": {"team": "u", "sha256": secrets.digest(SECRETS["plain"]).hex()}},
        "passthrough": [{"path": "/tokenize", "methods": ["POST"]}]}), revision=revision)


async def test_an_allowed_request_carries_its_keys_objective_and_a_push_changes_it() -> None:
    current = [policy(1, "premium")]
    clock = FakeClock(1_800_000_000.0)
    limiter = MemoryLimiter()
    authz = Authorizer(lambda: current[0], limiter, clock, AdmissionSettings(),
                       ledger=Ledger(limiter, clock, lease_ttl=30))
    n = 0

    async def upstream(who: str, path: str = "/v1/chat/completions",
                       body: bytes = b'{"model": "m", "max_tokens": 1}') -> dict[str, str]:
        nonlocal n
        n += 1
        decision = await authz.check(AuthzRequest(
            f"r{n}", "POST", path, {"authorization": f"Bearer {SECRETS[who]}", OBJ: "forged"},
            body))
        assert isinstance(decision, Allow), decision
        return dict(decision.context.caller.upstream)

    assert (await upstream("own"))[OBJ] == "premium"  # the key's, over its team's
    assert (await upstream("inherits"))[OBJ] == "batch"  # its team's
    plain = await upstream("plain")
    assert OBJ not in plain and plain[FAIR] == "u"
    passthrough = await upstream("inherits", "/tokenize", b'{"prompt": "hi"}')
    assert MODEL not in passthrough and passthrough[OBJ] == "batch"
    current[0] = policy(2, "interactive")  # a push: the next request has the new one
    assert (await upstream("own"))[OBJ] == "interactive"
    current[0] = policy(3, None)  # the key's own dropped: its team's applies
    assert (await upstream("own"))[OBJ] == "batch"
