"""The end of every request: exactly one usage event into the spool, one settlement."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from google.protobuf.struct_pb2 import Struct

from gateway import metrics
from gateway.errors import StoreUnavailable
from gateway.limits.types import Orphan
from gateway.log import log
from gateway.metering.events import UsageEvent, event_json, rfc3339
from gateway.metering.inject import Injected, Splice
from gateway.metering.lifecycle import Lifecycle
from gateway.metering.meter import Meter, Result
from gateway.metering.usage import Usage
from gateway.sinks.spool import Spool


@dataclass
class RequestFacts:
    """What ext_authz decided, forwarded by Envoy as metadata: the only context trusted."""

    request_id: str = ""
    key_id: str = ""
    team: str = ""
    model: str = ""
    endpoint: str = ""
    stream: bool = False
    leased: bool = False
    prompt_estimate: int = 0
    stream_options: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    denied_status: int = 0
    traceparent: str = ""  # the W3C trace context of a traced request
    splice: Splice | None = None  # what the Check planned to splice into the request

    @classmethod
    def from_struct(cls, md: Struct | None) -> RequestFacts:
        """From ext_authz's metadata Struct (read field by field: no dict conversion)."""
        if md is None:
            return cls()
        f = md.fields

        def text(k: str) -> str:
            return f[k].string_value if k in f else ""

        def flag(k: str) -> bool:
            return f[k].bool_value if k in f else False

        def num(k: str) -> int:
            return int(f[k].number_value) if k in f else 0

        return cls(
            request_id=text("request_id"), key_id=text("key_id"), team=text("team"),
            model=text("model"), endpoint=text("endpoint"), stream=flag("stream"),
            leased=flag("leased"), prompt_estimate=num("prompt_estimate"),
            stream_options=flag("stream_options"), include_usage=flag("include_usage"),
            continuous_usage=flag("continuous_usage"),
            denied_status=num("status") if "denied" in f else 0,
            traceparent=text("traceparent"),
            splice=Splice(num("splice_at"), num("splice_cut"), text("splice").encode(),
                          Injected(flag("hide_usage"), flag("hide_continuous")))
            if "splice" in f else None,
        )


class Recorder:
    def __init__(self, spool: Spool, spoke: str, lifecycle: Lifecycle) -> None:
        self.spool = spool
        self.spoke = spoke
        self.lifecycle = lifecycle

    async def run_sweeper(self, interval: float, grace: float = 0.0) -> None:
        """Give every orphaned request (its sidecar died mid-request) its one event, once
        its lease has been out for `grace` more seconds."""
        while True:
            await asyncio.sleep(interval)
            try:
                for o in await self.lifecycle.limiter.sweep(time.time() - grace):
                    self.orphan(o)
            except StoreUnavailable:
                continue
            except Exception:
                log.exception("orphan_sweep_crashed")

    def orphan(self, o: Orphan) -> UsageEvent:
        try:
            key_id, team, model, endpoint, stream = orjson.loads(o.meta)
        except (orjson.JSONDecodeError, ValueError, TypeError):
            key_id = team = model = endpoint = ""
            stream = False
        facts = RequestFacts(request_id=o.request_id, key_id=key_id, team=team, model=model,
                             endpoint=endpoint, stream=bool(stream))
        meter = Meter(endpoint=endpoint, stream=bool(stream))
        meter.reported = Usage(prompt_tokens=o.charged, total_tokens=o.charged)
        log.warning("orphaned_request", request_id=o.request_id, key_id=key_id,
                    charged=o.charged)
        return self.finish(facts, meter, "upstream_error", time.time(), source="estimated")

    def _settlement(self, facts: RequestFacts, tokens: int) -> Callable[[], None] | None:
        if not facts.leased:
            return None
        return lambda: self.lifecycle.settle(facts.request_id, tokens)

    def finish(self, facts: RequestFacts, meter: Meter, outcome: str, started: float,
               source: str | None = None) -> UsageEvent:
        """Emit the request's one event (never awaits: safe in a cancelled stream's finally)."""
        r = meter.result()
        if not facts.endpoint:
            facts.endpoint = meter.endpoint
        return self.emit(facts, r, meter.status or facts.denied_status, outcome, started,
                         time.time(), source or r.source)

    def emit(self, facts: RequestFacts, r: Result, status: int, outcome: str, started: float,
             ended: float, source: str) -> UsageEvent:
        """The event, into the spool; the leases freed now, the reservation settled once the
        event is durable. Both metering sources end here."""
        if facts.leased:
            self.lifecycle.release(facts.request_id)
        seq = self.spool.next_seq()
        event = UsageEvent(
            event_id=facts.request_id, spoke=self.spoke, instance_id=self.spool.instance_id,
            seq=seq, started_at=rfc3339(started), ended_at=rfc3339(ended),
            key_id=facts.key_id, team=facts.team, model=facts.model,
            served_model=r.served_model, endpoint=facts.endpoint,
            stream=facts.stream, status_code=status,
            outcome=outcome, usage=r.usage, usage_source=source,
            ttft_ms=round(r.ttft_ms, 3), tpot_ms=round(r.tpot_ms, 3),
            duration_ms=round((ended - started) * 1000, 3))
        self.spool.put(seq, event_json(event), on_durable=self._settlement(
            facts, r.usage.total_tokens if outcome != "denied" else 0))
        metrics.EVENTS.labels(outcome).inc()
        if r.usage.total_tokens:
            metrics.TOKENS.labels(facts.model, facts.team, "prompt").inc(r.usage.prompt_tokens)
            metrics.TOKENS.labels(facts.model, facts.team, "completion").inc(
                r.usage.completion_tokens)
        if r.ttft_ms:
            metrics.TTFT.labels(facts.model).observe(r.ttft_ms / 1000)
        if r.tpot_ms:
            metrics.TPOT.labels(facts.model).observe(r.tpot_ms / 1000)
        return event
