"""The end of every request: exactly one usage event into the spool, one settlement."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson

from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.errors import StoreUnavailable
from gateway.limits.types import Orphan
from gateway.log import log
from gateway.metering.events import rfc3339, to_json
from gateway.metering.lifecycle import Lifecycle
from gateway.metering.meter import Meter
from gateway.metering.usage import Usage
from gateway.server import metrics
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

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> RequestFacts:
        return cls(
            request_id=str(md.get("request_id", "")),
            key_id=str(md.get("key_id", "")),
            team=str(md.get("team", "")),
            model=str(md.get("model", "")),
            endpoint=str(md.get("endpoint", "")),
            stream=bool(md.get("stream", False)),
            leased=bool(md.get("leased", False)),
            prompt_estimate=int(md.get("prompt_estimate", 0) or 0),
            stream_options=bool(md.get("stream_options", False)),
            include_usage=bool(md.get("include_usage", False)),
            continuous_usage=bool(md.get("continuous_usage", False)),
            denied_status=int(md.get("status", 0) or 0) if "denied" in md else 0,
        )


class Recorder:
    def __init__(self, spool: Spool, spoke: str, lifecycle: Lifecycle) -> None:
        self.spool = spool
        self.spoke = spoke
        self.lifecycle = lifecycle

    async def run_sweeper(self, interval: float) -> None:
        """Give every orphaned request (its sidecar died mid-request) its one event."""
        while True:
            await asyncio.sleep(interval)
            try:
                orphans = await self.lifecycle.limiter.sweep(time.time())
            except StoreUnavailable:
                continue
            for o in orphans:
                self.orphan(o)

    def orphan(self, o: Orphan) -> int:
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

    def finish(self, facts: RequestFacts, meter: Meter, outcome: str, started: float,
               source: str | None = None) -> int:
        """Emit the request's one event (never awaits: safe in a cancelled stream's finally)."""
        r = meter.result()
        ended = time.time()
        if facts.leased:  # first, so nothing below can keep a lease from being released
            self.lifecycle.end(facts.request_id, r.usage.total_tokens if outcome != "denied"
                               else 0)
        seq = self.spool.next_seq()
        event = usage_pb2.UsageEvent(
            event_id=facts.request_id, spoke=self.spoke, instance_id=self.spool.instance_id,
            seq=seq, started_at=rfc3339(started), ended_at=rfc3339(ended),
            key_id=facts.key_id, team=facts.team, model=facts.model,
            served_model=r.served_model, endpoint=facts.endpoint or meter.endpoint,
            stream=facts.stream, status_code=meter.status or facts.denied_status,
            outcome=outcome,
            usage=usage_pb2.Usage(
                prompt_tokens=r.usage.prompt_tokens, completion_tokens=r.usage.completion_tokens,
                total_tokens=r.usage.total_tokens, cached_tokens=r.usage.cached_tokens,
                reasoning_tokens=r.usage.reasoning_tokens),
            usage_source=source or r.source,
            timing=usage_pb2.Timing(ttft_ms=round(r.ttft_ms, 3), tpot_ms=round(r.tpot_ms, 3),
                                    duration_ms=round((ended - started) * 1000, 3)),
        )
        self.spool.put(seq, to_json(event))
        metrics.EVENTS.labels(outcome).inc()
        if r.usage.total_tokens:
            metrics.TOKENS.labels(facts.model, facts.team, "prompt").inc(r.usage.prompt_tokens)
            metrics.TOKENS.labels(facts.model, facts.team, "completion").inc(
                r.usage.completion_tokens)
        if r.ttft_ms:
            metrics.TTFT.labels(facts.model).observe(r.ttft_ms / 1000)
        if r.tpot_ms:
            metrics.TPOT.labels(facts.model).observe(r.tpot_ms / 1000)
        return seq
