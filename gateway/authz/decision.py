"""A decision is a value: Allow (with the verified context), Deny (with the HTTP answer) or
Reply (an answer the gateway gives itself, from the policy)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.endpoints import Api
from gateway.limits.types import RateInfo
from gateway.metering.inject import Splice
from gateway.policy.billing_rules import DEFAULT_CANCEL_RULE, CancelRule


@dataclass(frozen=True, slots=True)
class Context:
    """Verified facts about an allowed request; sent to the engine and to ext_proc."""

    request_id: str
    key_id: str
    team: str
    model: str
    stream: bool
    reserved: int
    leased: bool
    endpoint: str = ""
    prompt_estimate: int = 0
    stream_options: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    splice: Splice | None = None  # what to splice into the request body so usage is reported
    cancelled: CancelRule = DEFAULT_CANCEL_RULE  # the team's billing rule for a client cancel


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
