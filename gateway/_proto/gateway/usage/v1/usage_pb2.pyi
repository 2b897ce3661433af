from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens", "reasoning_tokens", "cache_creation_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CREATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    cache_creation_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cache_creation_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms", "duration_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tpot_ms: float
    duration_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class Cancellation(_message.Message):
    __slots__ = ("billing_rule", "prompt_tokens", "generated_completion_tokens", "delivered_completion_tokens")
    BILLING_RULE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    billing_rule: str
    prompt_tokens: int
    generated_completion_tokens: int
    delivered_completion_tokens: int
    def __init__(self, billing_rule: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_completion_tokens: _Optional[int] = ..., delivered_completion_tokens: _Optional[int] = ...) -> None: ...

class UsageEvent(_message.Message):
    __slots__ = ("event_id", "spoke", "instance_id", "seq", "started_at", "ended_at", "key_id", "team", "model", "served_model", "endpoint", "stream", "status_code", "outcome", "usage", "usage_source", "timing", "cancellation", "cost", "price_effective")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPOKE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CANCELLATION_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    PRICE_EFFECTIVE_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    spoke: str
    instance_id: str
    seq: int
    started_at: str
    ended_at: str
    key_id: str
    team: str
    model: str
    served_model: str
    endpoint: str
    stream: bool
    status_code: int
    outcome: str
    usage: Usage
    usage_source: str
    timing: Timing
    cancellation: Cancellation
    cost: float
    price_effective: str
    def __init__(self, event_id: _Optional[str] = ..., spoke: _Optional[str] = ..., instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., started_at: _Optional[str] = ..., ended_at: _Optional[str] = ..., key_id: _Optional[str] = ..., team: _Optional[str] = ..., model: _Optional[str] = ..., served_model: _Optional[str] = ..., endpoint: _Optional[str] = ..., stream: _Optional[bool] = ..., status_code: _Optional[int] = ..., outcome: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., usage_source: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., cancellation: _Optional[_Union[Cancellation, _Mapping]] = ..., cost: _Optional[float] = ..., price_effective: _Optional[str] = ...) -> None: ...
