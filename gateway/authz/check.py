"""The Check, whichever door Envoy asks through (gRPC, or the HTTP door): the decision with
its metrics, denial log line (bounded: gateway/authz/denial_log.py) and span, undone when
Envoy gives up on it, and the answer as a value the servers' encoders write in their own
protocol (gateway/server/check_grpc.py, check_http.py). What an answer means lives here
once; how it looks on a wire, there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from opentelemetry.trace import Span, Status, StatusCode

from gateway import metrics
from gateway.authz import answers
from gateway.authz.decision import Allow, Decision, Deny, Reply, Shared
from gateway.authz.denial_log import DenialLog
from gateway.authz.engine import Authorizer
from gateway.authz.request import AuthzRequest
from gateway.endpoints import api_of
from gateway.envoy_contract import REQUEST_ID_HEADER
from gateway.metering import handoff

_ALLOWED = metrics.DECISIONS.labels("allowed", "", "")
_ANSWERED = metrics.DECISIONS.labels("answered", "", "")  # our own answer (GET /v1/models)
_JSON = ("content-type", "application/json")


class Tracer(Protocol):
    """What the Check needs of gateway.tracing.Tracing (which the core does not import: its
    exporter speaks gRPC)."""

    def start_traced(self, name: str, call_metadata: Iterable[tuple[str, str | bytes]] | None,
                     traceparent: str, tracestate: str = "") -> Span | None: ...


@dataclass(slots=True)
class Allowed:
    """Let the request through to the engine."""

    upstream: tuple[tuple[str, str], ...]  # headers to set on it (this request's own)
    shared: Shared  # and what its caller's requests of its shape share: headers, metadata
    remove: list[str]  # headers to remove from it
    client: dict[str, str]  # headers to add to the client's response
    metadata: handoff.Metadata  # this request's own metadata entries
    leased: bool  # its admission holds a lease: undo it if the answer never reaches Envoy


@dataclass(slots=True)
class LocalReply:
    """Envoy answers the client itself: a denial, or the gateway's own answer (GET
    /v1/models: a 2xx)."""

    status: int  # as the client is to see it
    headers: list[tuple[str, str]]
    body: bytes
    metadata: handoff.Metadata


Answer = Allowed | LocalReply


def answer(decision: Decision, req: AuthzRequest, traceparent: str = "") -> Answer:
    """The answer a decision means. A traced request's `traceparent` rides in the metadata
    to metering, which sees no request headers."""
    if isinstance(decision, Allow):
        c = decision.context
        return Allowed(
            ((REQUEST_ID_HEADER, c.request_id),),
            c.caller.shared(c.endpoint, c.stream, c.leased, c.stream_options, c.include_usage,
                            c.continuous_usage),
            answers.removed_headers(req.headers, c.caller.keeps),
            answers.allowed_headers(decision.rate, api_of(c.endpoint), c.request_id),
            handoff.allowed(c.request_id, c.reserved, c.prompt_estimate, traceparent, c.splice),
            c.leased)
    if isinstance(decision, Deny):
        return LocalReply(
            decision.status, [_JSON, *answers.denial_headers(decision, req.request_id).items()],
            answers.error_body(decision, req.request_id),
            handoff.denied(req.request_id, decision.reason, decision.status, decision.key_id,
                           decision.team, decision.model, req.path, traceparent,
                           decision.stream))
    # its metadata names the caller, without `denied`: its usage event is a completed
    # request that cost no tokens
    return LocalReply(decision.status, [_JSON], decision.body, handoff.replied(
        req.request_id, decision.key_id, decision.team, decision.model, req.path, traceparent))


def observe_decision(decision: Decision, seconds: float) -> None:
    metrics.CHECK_SECONDS.observe(seconds)
    if isinstance(decision, Deny):
        metrics.child(metrics.DECISIONS, "denied", decision.reason, decision.tier or "").inc()
    elif isinstance(decision, Allow):
        _ALLOWED.inc()
    else:
        _ANSWERED.inc()


class BodilessMeter(Protocol):
    """Emits the event of a request the Check answered itself whose answer has no body
    (gateway/metering/recorder.py Recorder.answered_without_body)."""

    def answered_without_body(self, md: handoff.Metadata, status: int,
                              started: float) -> object: ...


class Check:
    """One Check: decide, count, log, trace, and answer.

    `bodiless` (the ext_proc metering source, in a process with a spool): Envoy's local
    reply to a HEAD has no body, and an ext_proc asked only about bodies (response headers
    SKIP: the shipped configs' modes on the API's POST routes only) opens no stream for it,
    so the Check emits that request's event itself, marked `metered`: for a HEAD the shipped
    configs send response headers, and the stream they open for that reply emits none. The
    Envoy source records every request: None there."""

    def __init__(self, authorizer: Authorizer, tracer: Tracer | None = None,
                 bodiless: BodilessMeter | None = None) -> None:
        self.authorizer = authorizer
        self.tracing = tracer
        self.denials = DenialLog()  # its line, bounded under a flood
        self.bodiless = bodiless

    async def __call__(self, req: AuthzRequest,
                       call_metadata: Iterable[tuple[str, str | bytes]] | None = None) -> Answer:
        """The answer to `req` (`call_metadata`: the gRPC call's, which may carry the trace
        context). Cancelled (Envoy gave up on the Check: its client left, or its timeout
        passed), it undoes whatever the admission took."""
        span = self.span(req, call_metadata)
        head = req.method == "HEAD" and self.bodiless is not None  # the only extra work
        started = time.time() if head else 0.0
        decision = await self.decide(req, span)
        out = answer(decision, req, "" if span is None else req.headers.get("traceparent", ""))
        if head and isinstance(out, LocalReply) and self.bodiless is not None:
            self.bodiless.answered_without_body(out.metadata, out.status, started)
        return out

    async def decide(self, req: AuthzRequest, span: Span | None) -> Decision:
        t0 = time.perf_counter()
        try:
            decision = await self.authorizer.check(req)
        except asyncio.CancelledError:
            self.abandon(req.request_id)
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, "cancelled by Envoy"))
                span.end()
            raise
        observe_decision(decision, time.perf_counter() - t0)
        if isinstance(decision, Deny):
            self.denials.denied(req.request_id, decision)
        if span is not None:
            _annotate(span, decision)
            span.end()
        return decision

    def abandon(self, request_id: str) -> None:
        """Envoy gave up on this Check after it was answered (its answer never arrived):
        no metering will follow to release the admission, so undo it now rather than at
        the lease's end."""
        self.authorizer.abandon(request_id)

    def span(self, req: AuthzRequest,
             metadata: Iterable[tuple[str, str | bytes]] | None = None) -> Span | None:
        """A span when tracing is on and the request is traced (the trace context from the
        call's metadata, or the request's own headers)."""
        if self.tracing is None:
            return None
        return self.tracing.start_traced("ext_authz Check", metadata,
                                         req.headers.get("traceparent", ""),
                                         req.headers.get("tracestate", ""))


def _annotate(span: Span, decision: Decision) -> None:
    if isinstance(decision, Reply):
        span.set_attributes({"gateway.decision": "answered", "gateway.key_id": decision.key_id,
                             "gateway.team": decision.team})
        return
    if isinstance(decision, Allow):
        c = decision.context
        span.set_attributes({"gateway.request_id": c.request_id, "gateway.decision": "allowed",
                             "gateway.key_id": c.caller.key_id, "gateway.team": c.caller.team,
                             "gateway.model": c.caller.model,
                             "gateway.reserved_tokens": c.reserved})
        return
    span.set_attributes({"gateway.decision": "denied", "gateway.deny_reason": decision.reason,
                         "http.response.status_code": decision.status,
                         "gateway.key_id": decision.key_id, "gateway.team": decision.team,
                         "gateway.model": decision.model})
    if decision.tier:
        span.set_attribute("gateway.limit_tier", decision.tier)
    if decision.status >= 500:
        span.set_status(Status(StatusCode.ERROR, decision.message))
