from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AnyValue(_message.Message):
    __slots__ = ("string_value", "bool_value", "int_value", "double_value", "array_value", "kvlist_value", "bytes_value")
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_VALUE_FIELD_NUMBER: _ClassVar[int]
    ARRAY_VALUE_FIELD_NUMBER: _ClassVar[int]
    KVLIST_VALUE_FIELD_NUMBER: _ClassVar[int]
    BYTES_VALUE_FIELD_NUMBER: _ClassVar[int]
    string_value: str
    bool_value: bool
    int_value: int
    double_value: float
    array_value: ArrayValue
    kvlist_value: KeyValueList
    bytes_value: bytes
    def __init__(self, string_value: _Optional[str] = ..., bool_value: _Optional[bool] = ..., int_value: _Optional[int] = ..., double_value: _Optional[float] = ..., array_value: _Optional[_Union[ArrayValue, _Mapping]] = ..., kvlist_value: _Optional[_Union[KeyValueList, _Mapping]] = ..., bytes_value: _Optional[bytes] = ...) -> None: ...

class ArrayValue(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[AnyValue]
    def __init__(self, values: _Optional[_Iterable[_Union[AnyValue, _Mapping]]] = ...) -> None: ...

class KeyValueList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, values: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: AnyValue
    def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AnyValue, _Mapping]] = ...) -> None: ...

class InstrumentationScope(_message.Message):
    __slots__ = ("name", "version", "attributes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    attributes: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., attributes: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class Resource(_message.Message):
    __slots__ = ("attributes",)
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    attributes: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, attributes: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class ExportLogsServiceRequest(_message.Message):
    __slots__ = ("resource_logs",)
    RESOURCE_LOGS_FIELD_NUMBER: _ClassVar[int]
    resource_logs: _containers.RepeatedCompositeFieldContainer[ResourceLogs]
    def __init__(self, resource_logs: _Optional[_Iterable[_Union[ResourceLogs, _Mapping]]] = ...) -> None: ...

class ExportLogsServiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResourceLogs(_message.Message):
    __slots__ = ("resource", "scope_logs")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_LOGS_FIELD_NUMBER: _ClassVar[int]
    resource: Resource
    scope_logs: _containers.RepeatedCompositeFieldContainer[ScopeLogs]
    def __init__(self, resource: _Optional[_Union[Resource, _Mapping]] = ..., scope_logs: _Optional[_Iterable[_Union[ScopeLogs, _Mapping]]] = ...) -> None: ...

class ScopeLogs(_message.Message):
    __slots__ = ("scope", "log_records")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LOG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    scope: InstrumentationScope
    log_records: _containers.RepeatedCompositeFieldContainer[LogRecord]
    def __init__(self, scope: _Optional[_Union[InstrumentationScope, _Mapping]] = ..., log_records: _Optional[_Iterable[_Union[LogRecord, _Mapping]]] = ...) -> None: ...

class LogRecord(_message.Message):
    __slots__ = ("attributes",)
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    attributes: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, attributes: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class ExportTraceServiceRequest(_message.Message):
    __slots__ = ("resource_spans",)
    RESOURCE_SPANS_FIELD_NUMBER: _ClassVar[int]
    resource_spans: _containers.RepeatedCompositeFieldContainer[ResourceSpans]
    def __init__(self, resource_spans: _Optional[_Iterable[_Union[ResourceSpans, _Mapping]]] = ...) -> None: ...

class ExportTraceServiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResourceSpans(_message.Message):
    __slots__ = ("resource", "scope_spans")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_SPANS_FIELD_NUMBER: _ClassVar[int]
    resource: Resource
    scope_spans: _containers.RepeatedCompositeFieldContainer[ScopeSpans]
    def __init__(self, resource: _Optional[_Union[Resource, _Mapping]] = ..., scope_spans: _Optional[_Iterable[_Union[ScopeSpans, _Mapping]]] = ...) -> None: ...

class ScopeSpans(_message.Message):
    __slots__ = ("scope", "spans")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    scope: InstrumentationScope
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    def __init__(self, scope: _Optional[_Union[InstrumentationScope, _Mapping]] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("trace_id", "span_id", "trace_state", "parent_span_id", "name", "kind", "start_time_unix_nano", "end_time_unix_nano", "attributes", "events", "status", "flags")
    class SpanKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SPAN_KIND_UNSPECIFIED: _ClassVar[Span.SpanKind]
        SPAN_KIND_INTERNAL: _ClassVar[Span.SpanKind]
        SPAN_KIND_SERVER: _ClassVar[Span.SpanKind]
        SPAN_KIND_CLIENT: _ClassVar[Span.SpanKind]
        SPAN_KIND_PRODUCER: _ClassVar[Span.SpanKind]
        SPAN_KIND_CONSUMER: _ClassVar[Span.SpanKind]
    SPAN_KIND_UNSPECIFIED: Span.SpanKind
    SPAN_KIND_INTERNAL: Span.SpanKind
    SPAN_KIND_SERVER: Span.SpanKind
    SPAN_KIND_CLIENT: Span.SpanKind
    SPAN_KIND_PRODUCER: Span.SpanKind
    SPAN_KIND_CONSUMER: Span.SpanKind
    class Event(_message.Message):
        __slots__ = ("time_unix_nano", "name", "attributes")
        TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
        NAME_FIELD_NUMBER: _ClassVar[int]
        ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
        time_unix_nano: int
        name: str
        attributes: _containers.RepeatedCompositeFieldContainer[KeyValue]
        def __init__(self, time_unix_nano: _Optional[int] = ..., name: _Optional[str] = ..., attributes: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_STATE_FIELD_NUMBER: _ClassVar[int]
    PARENT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    END_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    trace_id: bytes
    span_id: bytes
    trace_state: str
    parent_span_id: bytes
    name: str
    kind: Span.SpanKind
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: _containers.RepeatedCompositeFieldContainer[KeyValue]
    events: _containers.RepeatedCompositeFieldContainer[Span.Event]
    status: Status
    flags: int
    def __init__(self, trace_id: _Optional[bytes] = ..., span_id: _Optional[bytes] = ..., trace_state: _Optional[str] = ..., parent_span_id: _Optional[bytes] = ..., name: _Optional[str] = ..., kind: _Optional[_Union[Span.SpanKind, str]] = ..., start_time_unix_nano: _Optional[int] = ..., end_time_unix_nano: _Optional[int] = ..., attributes: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Span.Event, _Mapping]]] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., flags: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("message", "code")
    class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_CODE_UNSET: _ClassVar[Status.StatusCode]
        STATUS_CODE_OK: _ClassVar[Status.StatusCode]
        STATUS_CODE_ERROR: _ClassVar[Status.StatusCode]
    STATUS_CODE_UNSET: Status.StatusCode
    STATUS_CODE_OK: Status.StatusCode
    STATUS_CODE_ERROR: Status.StatusCode
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    message: str
    code: Status.StatusCode
    def __init__(self, message: _Optional[str] = ..., code: _Optional[_Union[Status.StatusCode, str]] = ...) -> None: ...
