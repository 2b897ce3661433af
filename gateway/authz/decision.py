"""A decision is a value: Allow (with the verified context), Deny (with the HTTP answer) or
Reply (an answer the gateway gives itself, from the policy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway import envoy_contract as contract
from gateway.endpoints import Api
from gateway.limits.types import RateInfo
from gateway.metering import handoff
from gateway.metering.inject import Splice
from gateway.policy.billing_rules import DEFAULT_CANCEL_RULE, CancelRule
from gateway.token_weights import TokenWeights


class Shared:
    """What every allowed request of one caller and request shape carries alike: the
    caller's context headers for the engine and the metadata entries that repeat. Built
    once (Caller.shared), so a Check builds only its request's own part; an encoder keeps
    its encoding of it in `encoded` (one entry per encoder), so it encodes it once too."""

    __slots__ = ("encoded", "metadata", "upstream")

    def __init__(self, upstream: tuple[tuple[str, str], ...], metadata: handoff.Metadata
                 ) -> None:
        self.upstream = upstream
        self.metadata = metadata
        self.encoded: dict[str, Any] = {}


_SHAPES = 32  # the combinations of a request's five flags (Caller.shared)
_ENDPOINTS = 64  # the endpoints one caller's Shared are kept for (passthrough paths vary)


class Caller:
    """Who asked, for which model (one per policy revision, key and model: `Callers`), with
    the Shared part of its requests' answers, per endpoint and flags.

    `upstream` is the context headers its requests carry to the engine (the request id
    aside): the key, team, model (none without one), the key's InferenceObjective (none
    without one) and the team as GIE's fairness id. `keeps` names the x-gateway-* headers a
    request of it may keep from the client because ours overwrite them; every other one,
    an unset context header included, is removed (answers.removed_headers)."""

    __slots__ = ("_shared", "cancelled", "keeps", "key_id", "model", "objective", "team",
                 "upstream", "weights")

    def __init__(self, key_id: str, team: str, model: str,
                 cancelled: CancelRule = DEFAULT_CANCEL_RULE, objective: str = "",
                 weights: TokenWeights | None = None) -> None:
        self.key_id = key_id
        self.weights = weights  # the model's token weights (None: raw tokens)
        self.team = team
        self.model = model
        self.cancelled = cancelled
        self.objective = objective
        upstream = [(contract.KEY_ID_HEADER, key_id), (contract.TEAM_HEADER, team)]
        if model:
            upstream.append((contract.MODEL_HEADER, model))
        if objective:
            upstream.append((contract.OBJECTIVE_HEADER, objective))
        upstream.append((contract.FAIRNESS_ID_HEADER, team))
        self.upstream = tuple(upstream)
        self.keeps = frozenset((contract.REQUEST_ID_HEADER, *(k for k, _ in upstream)))
        self._shared: dict[str, list[Shared | None]] = {}

    def shared(self, endpoint: str, stream: bool, leased: bool, stream_options: bool,
               include_usage: bool, continuous_usage: bool) -> Shared:
        """The part of an allowed answer this caller's requests of one shape share: found by
        the endpoint, then by the flags as a number (no tuple to build and hash)."""
        shapes = self._shared.get(endpoint)
        if shapes is None:
            if len(self._shared) >= _ENDPOINTS:
                self._shared.clear()
            shapes = self._shared[endpoint] = [None] * _SHAPES
        i = stream + 2 * leased + 4 * stream_options + 8 * include_usage + 16 * continuous_usage
        found = shapes[i]
        if found is None:
            found = shapes[i] = Shared(self.upstream, handoff.caller(
                self.key_id, self.team, self.model, endpoint, stream, leased, stream_options,
                include_usage, continuous_usage, self.cancelled, self.weights))
        return found

    def __repr__(self) -> str:
        return (f"Caller({self.key_id!r}, {self.team!r}, {self.model!r}, {self.cancelled!r}, "
                f"{self.objective!r})")


class Callers:
    """The Caller of each (policy revision, key, model): a new revision starts afresh (its
    key may have moved team, or changed billing rule or objective); the size is bounded."""

    MAX = 4096

    def __init__(self) -> None:
        self._revision: int | None = None
        self._by_key: dict[str, dict[str, Caller]] = {}
        self._size = 0

    def get(self, revision: int, key_id: str, team: str, model: str,
            cancelled: CancelRule, objective: str = "",
            weights: TokenWeights | None = None) -> Caller:
        if revision != self._revision or self._size >= self.MAX:
            self._revision, self._by_key, self._size = revision, {}, 0
        models = self._by_key.get(key_id)
        if models is None:
            models = self._by_key[key_id] = {}
        caller = models.get(model)
        if caller is None:
            caller = models[model] = Caller(key_id, team, model, cancelled, objective,
                                            weights)
            self._size += 1
        return caller


@dataclass(frozen=True, slots=True)
class Context:
    """Verified facts about an allowed request; sent to the engine and to ext_proc."""

    request_id: str
    caller: Caller  # who asked, for which model
    stream: bool
    reserved: int
    leased: bool
    endpoint: str = ""
    prompt_estimate: int = 0
    stream_options: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    splice: Splice | None = None  # what to splice into the request body so usage is reported


@dataclass(frozen=True, slots=True)
class Allow:
    context: Context
    rate: RateInfo


@dataclass(frozen=True, slots=True)
class Deny:
    status: int
    code: str  # OpenAI error.code
    message: str
    reason: str  # metrics label: e.g. 'invalid_api_key', 'rps', 'store_unavailable'
    tier: str | None = None
    retry_after: float | None = None
    rate: RateInfo | None = None
    headers: dict[str, str] = field(default_factory=dict)
    key_id: str = ""  # who was denied, when known (an unknown key's 401 knows no one)
    team: str = ""
    model: str = ""
    error_type: str = ""  # OpenAI's error.type, when the code alone does not say it
    api: Api = Api.OPENAI  # the shape of the answer: the one the route's clients expect
    stream: bool = False  # the request asked for a stream (its event says so)


@dataclass(frozen=True, slots=True)
class Reply:
    """A request the gateway answers itself (e.g. GET /v1/models, from the policy)."""

    status: int
    body: bytes
    key_id: str
    team: str
    model: str = ""


Decision = Allow | Deny | Reply
