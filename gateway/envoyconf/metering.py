"""Metering done by Envoy's own filters (`GATEWAY_METERING=envoy`): no Python per chunk.

The sidecar still decides at the Check; Envoy does the byte work and sends one record per
request, at its end, to the sidecar, which builds the usage event (gateway/metering/record.py).
Why each piece (docs/envoy.md §6):

* **Lua** (`gateway/envoyconf/lua/metering.lua`): splices `stream_options` into the request
  where the Check said (`splice`, `splice_at`, `splice_cut` in ext_authz's metadata: no
  search of the body, byte-exact); on `text/event-stream` responses hides what was
  injected (the usage-only chunk, `"usage": null`, continuous usage), counts content
  events, so a stream cut before the engine reported usage can still be estimated, stamps
  the first one's time once (the record's TTFT: to the first token, as ext_proc's), and
  reads the `usage` numbers and the served `model` of the stream's events into the
  `llm.usage` namespace (chat and completions `usage`, the Responses API's
  `response.usage`, Anthropic's message_start and message_delta). Envoy 1.40's
  sse_to_metadata could read them declaratively, but it JSON-parses every event: measured,
  ~8 µs of Envoy CPU a chunk, where the Lua looks only at events with a `usage` object.
* **json_to_metadata** reads the same numbers from whole JSON answers.
* **OpenTelemetry access log over gRPC to the sidecar**, with a retry policy: measured,
  it lost no record over a 10 s sidecar outage where a logger without retries lost ~17 %
  over 2 s (at-least-once; the sidecar deduplicates on the request id). `common_config`
  is the only place Envoy 1.40 honours buffering for gRPC: records are flushed every 50 ms.
  Or (`gateway envoy-config --records-http`) **over OTLP/HTTP** to the sidecar's
  GATEWAY_RECORDS_HTTP_LISTEN: cheaper for the sidecar, but Envoy 1.40 never retries an
  HTTP export (measured: a 503, a reset or a timeout drops the batch), so a sidecar killed
  mid-batch loses it; not the default.
  Every request Envoy handled is logged (allowed, denied, cut, Envoy's own 413/503).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from datetime import timedelta

from gateway.envoy_contract import CACHE_CREATION_INPUT_TOKENS as CACHE_CREATION
from gateway.envoy_contract import CACHE_READ_INPUT_TOKENS as CACHE_READ
from gateway.envoy_contract import CACHED_TOKENS as CACHED
from gateway.envoy_contract import COMPLETION_TOKENS as COMPLETION
from gateway.envoy_contract import PROMPT_TOKENS as PROMPT
from gateway.envoy_contract import REASONING_TOKENS as REASONING
from gateway.envoy_contract import (
    RECORD_ATTRIBUTES,
    RECORDS_FLUSH_MS,
    SERVED_MODEL,
    USAGE_NAMESPACE,
)
from gateway.envoy_contract import TOTAL_TOKENS as TOTAL
from gateway.envoyconf import lua as envoy_lua
from gateway.envoyconf.filters import SIDECAR_CLUSTER, bodiless_answer, unanswered_check
from gateway.envoyconf.plain import quiet_imports

with quiet_imports():
    from envoy_data_plane.envoy.config.accesslog.v3 import (
        AccessLog,
        AccessLogFilter,
        OrFilter,
        ResponseFlagFilter,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        ApiVersion,
        BackoffStrategy,
        DataSource,
        GrpcService,
        GrpcServiceEnvoyGrpc,
        HttpService,
        HttpUri,
        RetryPolicy,
        TypedExtensionConfig,
    )
    from envoy_data_plane.envoy.extensions.access_loggers.grpc.v3 import (
        CommonGrpcAccessLogConfig,
    )
    from envoy_data_plane.envoy.extensions.access_loggers.open_telemetry.v3 import (
        OpenTelemetryAccessLogConfig,
    )
    from envoy_data_plane.envoy.extensions.common.matching.v3 import ExtensionWithMatcher
    from envoy_data_plane.envoy.extensions.filters.common.matcher.action.v3 import SkipFilter
    from envoy_data_plane.envoy.extensions.filters.http.json_to_metadata.v3 import (
        JsonToMetadata,
        JsonToMetadataKeyValuePair,
        JsonToMetadataMatchRules,
        JsonToMetadataRule,
        JsonToMetadataSelector,
        JsonToMetadataValueType,
    )
    from envoy_data_plane.envoy.extensions.filters.http.lua.v3 import Lua
    from envoy_data_plane.envoy.type.matcher.v3 import HttpResponseHeaderMatchInput, RegexMatcher
    from envoy_data_plane.google.protobuf import Any
    from envoy_data_plane.opentelemetry.proto.common.v1 import AnyValue, KeyValue, KeyValueList
    from envoy_data_plane.xds.core.v3 import TypedExtensionConfig as XdsTypedExtensionConfig
    from envoy_data_plane.xds.type.matcher.v3 import (
        Matcher,
        MatcherMatcherList,
        MatcherMatcherListFieldMatcher,
        MatcherMatcherListPredicate,
        MatcherMatcherListPredicateSinglePredicate,
        MatcherOnMatch,
    )
    from envoy_data_plane.xds.type.matcher.v3 import RegexMatcher as XdsRegexMatcher
    from envoy_data_plane.xds.type.matcher.v3 import (
        RegexMatcherGoogleRe2 as XdsRegexMatcherGoogleRe2,
    )
    from envoy_data_plane.xds.type.matcher.v3 import StringMatcher as XdsStringMatcher

LUA = "envoy.filters.http.lua"
JSON_TO_METADATA = "envoy.filters.http.json_to_metadata"
OTEL_ACCESS_LOG = "envoy.access_loggers.open_telemetry"
RECORD_LOG_NAME = "gateway.usage"
# Every FLUSH, the records so far go as one Export. 20 ms instead was measured (docs/
# benchmarks.md, "2026-12-06: a shorter records flush"): the c=1 p99 ~0.6 ms lower and
# concurrency slots freed in 13/22 ms p50/p99 after the end instead of 27/53, but the
# sidecar's CPU a request +3-12 % at c=32 and +26-40 % at 50 req/s, and Envoy's CPU a
# stream chunk 1.9-2.0x plain's instead of 1.6x (the sidecar reads the batches on Envoy's
# core, in the middle of its streams): so 50 by default, and `gateway envoy-config
# --records-flush-ms` for an operator who wants the other side (the benches vary it too).
FLUSH = timedelta(milliseconds=RECORDS_FLUSH_MS)
# Envoy sends a batch when it holds this many bytes of records, or every FLUSH, whichever
# comes first. Its default (16 KiB, ~20 records) sent a batch every ~15 ms at 1,400 req/s,
# and each batch costs the sidecar a gRPC call, a group commit and a Redis round trip
# whatever it carries; FLUSH alone now decides (the gRPC limit is 4 MiB a message).
BUFFER_BYTES = 1 << 20
RECORDS_HTTP_CLUSTER = "sidecar_records_http"  # the records over OTLP/HTTP, when configured
RECORDS_HTTP_PATH = "/v1/logs"  # OTLP/HTTP's, served by gateway/server/records_http.py
# An HTTP export is answered once its events are durable (milliseconds); one timed out is
# dropped, never sent again
RECORDS_HTTP_TIMEOUT = timedelta(seconds=5)
# While a request is in flight Envoy also sends a periodic record for it (%ACCESS_LOG_TYPE%
# DownstreamPeriodic) every this often: the sidecar's proof that the request is still
# alive, and its usage so far. An admission nobody reports for a while is given up
# (docs/request-flow.md "Every admission ends"); GATEWAY_RECORD_HEARTBEAT_S must equal it.
RECORD_HEARTBEAT = timedelta(seconds=10)

# (metadata key, selector path, type): chat/completions/embeddings `usage`, then the
# Responses API's (`usage` of a whole answer, `response.usage` of its stream's last event).
_NUMBER, _STRING = JsonToMetadataValueType.NUMBER, JsonToMetadataValueType.STRING
USAGE_RULES: tuple[tuple[str, tuple[str, ...], JsonToMetadataValueType], ...] = (
    (PROMPT, ("usage", "prompt_tokens"), _NUMBER),
    (COMPLETION, ("usage", "completion_tokens"), _NUMBER),
    (TOTAL, ("usage", "total_tokens"), _NUMBER),
    (CACHED, ("usage", "prompt_tokens_details", "cached_tokens"), _NUMBER),
    (REASONING, ("usage", "completion_tokens_details", "reasoning_tokens"), _NUMBER),
    (PROMPT, ("usage", "input_tokens"), _NUMBER),  # a whole Responses API answer
    (COMPLETION, ("usage", "output_tokens"), _NUMBER),
    (CACHED, ("usage", "input_tokens_details", "cached_tokens"), _NUMBER),
    (REASONING, ("usage", "output_tokens_details", "reasoning_tokens"), _NUMBER),
    (PROMPT, ("response", "usage", "input_tokens"), _NUMBER),  # its stream's events
    (COMPLETION, ("response", "usage", "output_tokens"), _NUMBER),
    (TOTAL, ("response", "usage", "total_tokens"), _NUMBER),
    (CACHED, ("response", "usage", "input_tokens_details", "cached_tokens"), _NUMBER),
    (REASONING, ("response", "usage", "output_tokens_details", "reasoning_tokens"),
     _NUMBER),
    # Anthropic Messages: input_tokens / output_tokens above (a whole answer's `usage`, and a
    # stream's cumulative message_delta, which replaces what came before, key by key); the
    # input side of message_start; the cache counts, which record.py adds to the prompt.
    (PROMPT, ("message", "usage", "input_tokens"), _NUMBER),
    (CACHE_READ, ("message", "usage", "cache_read_input_tokens"), _NUMBER),
    (CACHE_CREATION, ("message", "usage", "cache_creation_input_tokens"),
     _NUMBER),
    (CACHE_READ, ("usage", "cache_read_input_tokens"), _NUMBER),
    (CACHE_CREATION, ("usage", "cache_creation_input_tokens"), _NUMBER),
)
MODEL_RULES = ((SERVED_MODEL, ("model",), _STRING), (SERVED_MODEL, ("response", "model"), _STRING),
               (SERVED_MODEL, ("message", "model"), _STRING))

def lua() -> Lua:
    return Lua(default_source_code=DataSource(inline_string=envoy_lua.source()))


def _rule(key: str, path: tuple[str, ...], kind: JsonToMetadataValueType) -> JsonToMetadataRule:
    return JsonToMetadataRule(
        selectors=[JsonToMetadataSelector(key=k) for k in path],
        on_present=JsonToMetadataKeyValuePair(metadata_namespace=USAGE_NAMESPACE, key=key,
                                              type=kind))


def json_to_metadata() -> JsonToMetadata:
    """Whole JSON answers. Engines add parameters (`application/json; charset=utf-8`), which
    the filter's exact default ("application/json") would not match."""
    rules = [_rule(*r) for r in (*USAGE_RULES, *MODEL_RULES)]
    return JsonToMetadata(response_rules=JsonToMetadataMatchRules(
        rules=rules, allow_content_types_regex=RegexMatcher(regex=r"^application/json\b.*")))


def json_to_metadata_filter(max_bytes: int) -> ExtensionWithMatcher:
    """json_to_metadata, skipped for an answer whose content-length says it is larger than
    `max_bytes` (the stream's buffer limit). The filter buffers the whole body to read it, and
    Envoy answers 500 for a body past the buffer limit, after the engine did the work: a
    12 MB embeddings answer (a few hundred inputs of a large model) never reached its
    client. Skipped, it passes untouched and its usage is estimated, as ext_proc does
    for a body it does not parse (gateway/metering/meter.py MAX_JSON_BODY). An answer
    without a content-length (chunked) is still read whole."""
    too_large = MatcherMatcherListPredicate(
        single_predicate=MatcherMatcherListPredicateSinglePredicate(
            input=XdsTypedExtensionConfig(
                name="content-length",
                typed_config=Any.pack(HttpResponseHeaderMatchInput(header_name="content-length"))),
            value_match=XdsStringMatcher(
                safe_regex=XdsRegexMatcher(google_re2=XdsRegexMatcherGoogleRe2(),
                                           regex=above_regex(max_bytes)))))
    skip = MatcherOnMatch(action=XdsTypedExtensionConfig(
        name="skip", typed_config=Any.pack(SkipFilter())))
    return ExtensionWithMatcher(
        xds_matcher=Matcher(matcher_list=MatcherMatcherList(matchers=[
            MatcherMatcherListFieldMatcher(predicate=too_large, on_match=skip)])),
        extension_config=TypedExtensionConfig(name=JSON_TO_METADATA,
                                              typed_config=Any.pack(json_to_metadata())))


def above_regex(limit: int) -> str:
    """An RE2 regex matching exactly the decimal numbers greater than `limit` (leading zeros
    allowed), for a header no numeric matcher reads."""
    digits = str(limit)
    n = len(digits)
    longer = f"[1-9][0-9]{{{n},}}"  # more digits
    same = [digits[:i] + ("9" if d == "8" else f"[{int(d) + 1}-9]")
            + (f"[0-9]{{{n - i - 1}}}" if i < n - 1 else "")
            for i, d in enumerate(digits) if d != "9"]  # as many: larger at the first digit
    return f"^0*(?:{'|'.join([longer, *same])})$"


def record_log(only_flags: Iterable[str] = (), http: bool = False,
               flush: timedelta = FLUSH, unanswered_on: Iterable[str] = ()) -> AccessLog:
    """The per-request record to the sidecar: OTLP logs over gRPC, retried for ~36 s, or
    (`http`) over OTLP/HTTP, never retried.

    `only_flags`: send a record only for requests with one of these response flags. The
    ext_proc source uses it to learn who ended a stream that ended early (UPE: the engine;
    DC: the client), which ext_proc itself cannot see; and, with `unanswered_on` (paths),
    for a POST there whose Check failed, which no ext_proc stream sees
    (filters.unanswered_check), or whose answer had no body, which ends its stream as a cut
    does (filters.bodiless_answer: the record gives its status, with no flag). `flush`: how
    often Envoy sends a batch (FLUSH unless `gateway envoy-config --records-flush-ms` says
    otherwise)."""
    only = AccessLogFilter(response_flag_filter=ResponseFlagFilter(
        flags=sorted(only_flags))) if only_flags else None
    if only is not None and (paths := tuple(unanswered_on)):
        only = AccessLogFilter(or_filter=OrFilter(filters=[
            only, unanswered_check(paths), bodiless_answer(paths)]))
    if http:
        return AccessLog(name=OTEL_ACCESS_LOG, filter=only,
                         typed_config=Any.pack(_otel_http_config(flush)))
    retry = RetryPolicy(
        retry_back_off=BackoffStrategy(base_interval=timedelta(milliseconds=250),
                                       max_interval=timedelta(seconds=2)),
        num_retries=20,
        retry_on="connect-failure,refused-stream,unavailable,reset,cancelled,"
                 "deadline-exceeded,resource-exhausted")
    grpc = GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=SIDECAR_CLUSTER),
                       retry_policy=retry)
    with warnings.catch_warnings():  # common_config is deprecated, but the only place
        warnings.simplefilter("ignore", DeprecationWarning)  # 1.40 honours gRPC's buffering
        return AccessLog(name=OTEL_ACCESS_LOG, filter=only,
                         typed_config=Any.pack(_otel_config(grpc, flush)))


def _otel_config(grpc: GrpcService, flush: timedelta) -> OpenTelemetryAccessLogConfig:
    return OpenTelemetryAccessLogConfig(
        common_config=CommonGrpcAccessLogConfig(
            log_name=RECORD_LOG_NAME, transport_api_version=ApiVersion.V3, grpc_service=grpc,
            buffer_flush_interval=flush, buffer_size_bytes=BUFFER_BYTES),
        disable_builtin_labels=True,
        attributes=_attributes(),
    )


def _otel_http_config(flush: timedelta) -> OpenTelemetryAccessLogConfig:
    """The same records over OTLP/HTTP: the top-level buffering fields are honoured here."""
    uri = HttpUri(uri=f"http://{RECORDS_HTTP_CLUSTER}{RECORDS_HTTP_PATH}",
                  cluster=RECORDS_HTTP_CLUSTER, timeout=RECORDS_HTTP_TIMEOUT)
    return OpenTelemetryAccessLogConfig(
        http_service=HttpService(http_uri=uri), log_name=RECORD_LOG_NAME,
        buffer_flush_interval=flush, buffer_size_bytes=BUFFER_BYTES,
        disable_builtin_labels=True, attributes=_attributes())


def _attributes() -> KeyValueList:
    return KeyValueList(values=[
        KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in RECORD_ATTRIBUTES.items()])
