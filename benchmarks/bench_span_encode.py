"""CPU to encode a batch of the sidecar's spans as OTLP: our exporter's `encode` against the
OTel SDK exporter's encoder it replaced (issue 20), on the same spans, in one process.

    .venv/bin/python benchmarks/bench_span_encode.py [--quick] [--batch 512] [--rounds 7]
        [--out benchmarks/results/span_encode.json]

Spans look like the Check's (a remote parent, eight attributes). The SDK's encoder needs
opentelemetry-exporter-otlp-proto-common and the real opentelemetry-proto (not xds-protos'
0.x copy), no longer dependencies: where they are missing only ours is measured.
Prints CPU µs per span (median of the rounds) for each, encode + SerializeToString.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    TraceFlags,
    set_span_in_context,
)

from gateway.tracing_otlp import encode


def spans(n: int) -> Sequence[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("gateway")
    for i in range(n):
        parent = set_span_in_context(NonRecordingSpan(SpanContext(
            trace_id=i + 1, span_id=i + 1, is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        with tracer.start_as_current_span("ext_authz Check", context=parent,
                                          kind=SpanKind.SERVER) as s:
            s.set_attributes({
                "gateway.request_id": f"req-{i:08d}", "gateway.decision": "allowed",
                "gateway.key_id": "key_7Hq2", "gateway.team": "team-a",
                "gateway.model": "qwen3-coder", "gateway.endpoint": "/v1/chat/completions",
                "gateway.reserved_tokens": 1200, "gateway.stream": True})
    return memory.get_finished_spans()


def per_span_us(fn: Callable[[], bytes], n: int, rounds: int) -> float:
    fn()  # warm
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) / n * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: 64 spans, 3 rounds")
    parser.add_argument("--batch", type=int, default=512)  # the SDK's max export batch
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "span_encode.json"))
    args = parser.parse_args()
    n, rounds = (64, 3) if args.quick else (args.batch, args.rounds)
    batch = spans(n)
    result: dict[str, object] = {"spans": n, "rounds": rounds, "sdk_encoder": None}
    ours = per_span_us(lambda: encode(batch).SerializeToString(), n, rounds)
    result["ours_us_per_span"] = round(ours, 2)
    print(f"ours (gateway.tracing_otlp.encode): {ours:.1f} µs/span")
    try:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    except ImportError as exc:
        print(f"SDK encoder not importable here ({exc}): only ours measured")
    else:
        sdk = per_span_us(lambda: encode_spans(batch).SerializeToString(), n, rounds)
        result["sdk_encoder"] = {"us_per_span": round(sdk, 2), "ours_ratio": round(ours / sdk, 3)}
        print(f"OTel SDK exporter's encoder:        {sdk:.1f} µs/span  (ours {ours / sdk:.2f}x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
