"""Every name the sidecar shares with Envoy and with the Lua filter, in one leaf module.

Envoy's config (gateway/envoyconf/), the Check's encoders (gateway/server/check_*.py),
metering's readers (gateway/metering/) and the Lua filter (its constants block is generated
from here when gateway/envoyconf/lua renders it) all spell these names from here, so no
side can rename one alone. It imports nothing of the gateway: any layer may use it.
"""

from __future__ import annotations

# -- dynamic metadata namespaces -----------------------------------------------------------

# Envoy files ext_authz's dynamic metadata under this namespace, whatever the filter is named.
AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
EXTPROC_NAMESPACE = "gateway.usage"  # the only metadata namespace ext_proc may write
USAGE_NAMESPACE = "llm.usage"  # the Lua filter (streams) and json_to_metadata write usage here
STREAM_NAMESPACE = "llm.stream"  # the Lua filter writes its content counters here
# ext_proc's request attributes (request.id, request.path, response.code) arrive under this
EXTPROC_ATTRIBUTES = "envoy.filters.http.ext_proc"

# -- the Check's metadata (written by gateway/metering/handoff.py) -------------------------

# The splice the Lua filter applies to the request, and what it hides from the response.
SPLICE = "splice"
SPLICE_AT = "splice_at"
SPLICE_CUT = "splice_cut"
HIDE_USAGE = "hide_usage"
HIDE_CONTINUOUS = "hide_continuous"
# The Check itself emitted this request's usage event (a refused HEAD under ext_proc
# metering: its answer has no body, so no ext_proc stream would): metering emits none.
METERED = "metered"
# Every key a Check may write (the HTTP door sends each as a header of this name, and
# Envoy's `dynamic_metadata_from_headers` lists exactly these).
# The model's token weights, "input:cached_input:cache_creation:output", only when it has
# weights other than all 1 (gateway/token_weights.py): metering weighs the settlement by them.
TOKEN_WEIGHTS = "token_weights"
METADATA_KEYS = ("request_id", "reserved", "prompt_estimate", "traceparent", SPLICE,
                 SPLICE_AT, SPLICE_CUT, HIDE_USAGE, HIDE_CONTINUOUS, "key_id", "team",
                 "model", "stream", "leased", "endpoint", "stream_options", "include_usage",
                 "continuous_usage", "cancelled", "denied", "status", METERED, TOKEN_WEIGHTS)

# -- what the Lua filter writes (USAGE_NAMESPACE, STREAM_NAMESPACE) ------------------------

PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
TOTAL_TOKENS = "total_tokens"
CACHED_TOKENS = "cached_tokens"
REASONING_TOKENS = "reasoning_tokens"
CACHE_READ_INPUT_TOKENS = "cache_read_input_tokens"
CACHE_CREATION_INPUT_TOKENS = "cache_creation_input_tokens"
SERVED_MODEL = "model"  # the first "model" string a stream names
CONTENT_EVENTS = "content_events"
CONTENT_CHARS = "content_chars"
STREAM_DONE = "done"  # the engine's own end marker passed
STREAM_FAILED = "failed"  # the engine reported a failure inside the stream
# When the first content event passed the filter: epoch microseconds as a string (Envoy's
# timestampString), set once. The record's reader takes TTFT and TPOT from it.
FIRST_CONTENT_US = "first_content_us"

# -- headers -------------------------------------------------------------------------------

# The verified context an allowed request carries to the engine. A client's own x-gateway-*
# headers are forged context: ours overwrite theirs, the rest are removed, with the key.
REQUEST_ID_HEADER = "x-gateway-request-id"
KEY_ID_HEADER = "x-gateway-key-id"
TEAM_HEADER = "x-gateway-team"
MODEL_HEADER = "x-gateway-model"  # none when the request names no model (a pass-through)
# The Gateway API Inference Extension's (GIE, llm-d) scheduling headers: the name of an
# InferenceObjective (its endpoint picker resolves it to a priority; none when the key and
# its team name none), and the flow fair-share queueing shares among (the key's team).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
# A context header the gateway does not set on a request (no model, no objective) is removed
# from it: a client's own value never reaches the engine (gateway/authz/decision.py Caller).
CONTEXT_HEADERS = (REQUEST_ID_HEADER, KEY_ID_HEADER, TEAM_HEADER, MODEL_HEADER,
                   OBJECTIVE_HEADER, FAIRNESS_ID_HEADER)
CONTEXT_PREFIX = "x-gateway-"
CREDENTIALS = ("authorization", "x-api-key")
# Envoy's own flag on a Check whose body it buffered: "true" when it sent only the start of
# it (`with_request_body.allow_partial_message: true`; ours says false, a managed Envoy may not)
PARTIAL_BODY_HEADER = "x-envoy-auth-partial-body"
# A body the Check cannot read (compressed) names no model it can judge, but an engine that
# decompresses requests reads one: the Check sees this header and refuses any encoding
CONTENT_ENCODING = "content-encoding"

# ext_authz's HTTP door (gateway/server/check_http.py): which answer headers Envoy passes on.
RATE_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")  # to the client, allowed or denied
# Anthropic's own request id header (its SDK reads it); the gateway's is x-request-id's value
ANTHROPIC_REQUEST_ID = "request-id"
CLIENT_HEADERS = ("content-type", "retry-after", "x-should-retry", "x-gateway-limit-tier",
                  ANTHROPIC_REQUEST_ID)
CLIENT_HEADERS_ON_SUCCESS = (ANTHROPIC_REQUEST_ID,)  # besides RATE_PREFIXES
REMOVE_HEADER = "x-envoy-auth-headers-to-remove"  # names the headers to drop upstream
# The status a decision means -> the status that carries it to Envoy (and back, in Envoy's
# local-reply mappers): unassigned codes, so nothing else answers with them. Envoy reads a
# 5xx from the door as the door failing, and a 200 as an allow.
WIRE_STATUS = {200: 250, 503: 450}

# -- Envoy's per-request record (GATEWAY_METERING=envoy) -----------------------------------

# %RESPONSE_FLAGS% that mean the engine (or the way to it) failed: UPE is an engine that
# cut its stream after the headers; the rest fail before or while connecting.
UPSTREAM_FLAGS = frozenset({"UPE", "UR", "UC", "UF", "URX", "UT", "UO", "UH", "NR", "UMSDR"})
CLIENT_FLAGS = frozenset({"DC", "DPE"})  # the client left, or broke the protocol
CUT_FLAGS = UPSTREAM_FLAGS | CLIENT_FLAGS  # a stream that ended early: who ended it
# %ACCESS_LOG_TYPE% of the record Envoy sends every heartbeat while a request is in flight
PERIODIC = "DownstreamPeriodic"

# One record per request: what the sidecar needs to build its usage event. All strings
# (the formatter's output); gateway/metering/record.py parses them. The attribute names:
REC_ID, REC_TYPE, REC_PATH, REC_CODE, REC_FLAGS = "rid", "type", "path", "code", "flags"
REC_START, REC_DURATION_US, REC_TOTAL_MS = "start", "duration_us", "total_ms"
REC_TTFT_US, REC_GEN_US = "ttft_us", "gen_us"
REC_AUTHZ, REC_USAGE, REC_COUNTED = "authz", "usage", "counted"  # metadata, as JSON
REC_DETAILS = "details"
# Envoy's response code details when ext_authz fails (the sidecar down, slower than the
# timeout, or its door answering a 5xx), as against a denial's `ext_authz_denied`.
AUTHZ_ERROR_DETAILS = "ext_authz_error"
RECORD_ATTRIBUTES = {
    REC_ID: "%REQ(X-REQUEST-ID)%",
    REC_TYPE: "%ACCESS_LOG_TYPE%",  # PERIODIC (a heartbeat) or DownstreamEnd
    REC_PATH: "%REQ(:PATH)%",
    REC_CODE: "%RESPONSE_CODE%",
    REC_FLAGS: "%RESPONSE_FLAGS%",
    REC_DETAILS: "%RESPONSE_CODE_DETAILS%",  # read for the ext_proc source's failed Checks
    REC_START: "%START_TIME(%s.%6f)%",
    REC_DURATION_US: "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
    # A cut stream never sent its last byte (no DS_TX_END): its whole life, in ms
    REC_TOTAL_MS: "%DURATION%",
    REC_TTFT_US: "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
    REC_GEN_US: "%COMMON_DURATION(US_RX_BODY_BEG:US_RX_END:us)%",
    REC_AUTHZ: f"%DYNAMIC_METADATA({AUTHZ_NAMESPACE})%",
    REC_USAGE: f"%DYNAMIC_METADATA({USAGE_NAMESPACE})%",
    REC_COUNTED: f"%DYNAMIC_METADATA({STREAM_NAMESPACE})%",
}
# How often Envoy sends the records it holds, by default (`gateway envoy-config
# --records-flush-ms`): a finished request's concurrency slot is freed up to this late,
# which GATEWAY_CONCURRENCY_GRACE_MS covers. Why 50: gateway/envoyconf/metering.py.
RECORDS_FLUSH_MS = 50
