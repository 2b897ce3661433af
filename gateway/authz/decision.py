"""A decision is a value: Allow (with the verified context), Deny (with the HTTP answer) or
Reply (an answer the gateway gives itself, from the policy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway import envoy_contract as contract
from gateway.endpoints import Api
from gateway.limits.types import RateInfo
from gateway.metering import handoff
from gateway.metering.cancel import DEFAULT_CANCEL_RULE, CancelRule
from gateway.metering.inject import Splice


class Caller:
    """What every allowed request of one key and model carries alike, within one policy
    revision: the context headers for the engine and the caller's metadata. Built once
    (`Callers`), so a Check builds only its request's own part; an encoder keeps its
    encoding of it in `encoded` (one entry per encoder), so it encodes it once too."""

    __slots__ = ("cancelled", "encoded", "key_id", "metadata", "model", "team", "upstream")

    def __init__(self, key_id: str, team: str, model: str,
                 cancelled: CancelRule = DEFAULT_CANCEL_RULE) -> None:
        self.key_id = key_id
        self.team = team
        self.model = model
        self.cancelled = cancelled
        self.upstream = ((contract.KEY_ID_HEADER, key_id), (contract.TEAM_HEADER, team),
                         (contract.MODEL_HEADER, model))
        self.metadata = handoff.caller(key_id, team, model, cancelled)
        self.encoded: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Caller({self.key_id!r}, {self.team!r}, {self.model!r}, {self.cancelled!r})"


class Callers:
    """The Caller of each (policy revision, key, model): a new revision starts afresh (its
    key may have moved team, or changed billing rule); the size is bounded."""

    MAX = 4096

    def __init__(self) -> None:
        self._revision: int | None = None
        self._by_key: dict[str, dict[str, Caller]] = {}
        self._size = 0

    def get(self, revision: int, key_id: str, team: str, model: str,
            cancelled: CancelRule) -> Caller:
        if revision != self._revision or self._size >= self.MAX:
            self._revision, self._by_key, self._size = revision, {}, 0
        models = self._by_key.get(key_id)
        if models is None:
            models = self._by_key[key_id] = {}
        caller = models.get(model)
        if caller is None:
            caller = models[model] = Caller(key_id, team, model, cancelled)
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
