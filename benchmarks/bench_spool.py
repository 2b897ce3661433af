"""Usage events per second through the durable spool into Kafka, on one core.

    .venv/bin/python benchmarks/bench_spool.py [--quick] [--out benchmarks/results/spool.json]

In one process (the sidecar's own code, no gRPC): a `Spool` (group-committed, fsync'd
JSON lines), its writer task, and a `Shipper` draining it into a `KafkaProducer` (aiokafka,
acks=all, idempotence off as for Tansu) against a real Tansu broker (memory storage).
An appender task ends N requests the way the sidecar does, with the real
`gateway.metering.recorder.Recorder.finish` (event JSON, spool.next_seq(), spool.put(),
metrics) on a 64-token stream's Meter, at full speed, yielding to the loop after each
event, as the sidecar's request streams would. The clock
stops when the shipper has marked all N delivered.

Two variants, each with its own spool, alternating over the rounds (quick 1, full 3):
* `build+ship`: the appender builds every event (what the sidecar pays per request), so
  events trickle in and group commits and Kafka batches stay small;
* `ship only`: the lines were built beforehand, so only spool, fsync and Kafka are timed;
  all N are queued almost at once, so its lags are queueing behind the backlog.

Reported: events/s (wall, and per CPU-second of this process: `time.process_time`, all its
threads, i.e. the fsync thread too), fsyncs (calls of `Segments.append`, which is what
`commit()` does when its queue is not empty) and their mean batch, producer batches,
put -> durable and put -> delivered lag, and the cost of building one event. At the end the
topic is read back from the beginning and every event_id must be there, exactly once.

With two CPUs, this process (and the fsync thread it starts later) is pinned to CPU 1 and
Tansu to CPU 0, so "per core" means this process's core. The spool lives in a temporary
directory (on the same filesystem as --dir); fsync on tmpfs would be free, and the file
system type is recorded in the JSON. Before measuring, a probe checks that a put() while a
group commit is in flight is neither refused nor lost (the bug fixed in d8ac40e).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common import git_state, markdown_table, pin

from devspoke.procs import Service, free_port, tansu_service
from devspoke.usage_topic import USAGE_TOPIC, read_topic
from gateway.metering.handoff import RequestFacts
from gateway.metering.meter import Meter
from gateway.metering.recorder import Recorder
from gateway.sinks.gate import UsageGate
from gateway.sinks.producers import KafkaProducer, Record
from gateway.sinks.shipper import Shipper
from gateway.sinks.spool import Spool
from gateway.usage_event import Usage

HERE = Path(__file__).resolve().parent
TARGET_EVENTS_PER_S = 5000
BENCH_CPU, BROKER_CPU = 1, 0
VARIANTS = (("build+ship", False), ("ship only", True))


# --------------------------------------------------------------------------- events


class Capture:
    """Stands in for the spool where only the lines are wanted (built ahead, or timed)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.last_seq = 0
        self.lines: list[bytes] = []
        self.gate = UsageGate()  # open: the spool's, which the recorder follows

    def next_seq(self) -> int:
        self.last_seq += 1
        return self.last_seq

    def put(self, seq: int, line: bytes, on_durable: Any = None) -> None:
        self.lines.append(line)  # nothing becomes durable here: on_durable never runs


def finished_request(i: int, event_id: str) -> tuple[RequestFacts, Meter, float]:
    """What ext_proc holds at the end of a completed 64-token stream with reported usage."""
    endpoint = "/v1/chat/completions"
    facts = RequestFacts(request_id=event_id, key_id="key-0042", team="team-research",
                         model="mock-model", endpoint=endpoint, stream=True)
    meter = Meter(endpoint=endpoint, stream=True)
    meter.response_headers(200, "text/event-stream")
    prompt = 23 + i % 17
    meter.reported = Usage(prompt, 64, prompt + 64)
    meter.served_model = "mock-model-2025-01"
    now = time.monotonic()
    meter.started, meter.first_token, meter.last_token = now - 0.4, now - 0.35, now
    meter.content_events = 64
    return facts, meter, time.time() - 0.4


def recorder_for(spool: Spool | Capture) -> Recorder:
    # lifecycle is only used for leased requests, and these are not
    return Recorder(spool, "bench", None)  # type: ignore[arg-type]


def emit(recorder: Recorder, i: int, event_id: str) -> None:
    """One request's end, exactly as the sidecar does it: Recorder.finish (event JSON,
    next_seq, put, metrics)."""
    facts, meter, started = finished_request(i, event_id)
    recorder.finish(facts, meter.facts(ended=True), started)


def build_cost_us(n: int) -> dict[str, float]:
    """Median over 5 repeats of the µs per Recorder.finish (the request state is made first,
    untimed) into a Capture: building the event and its JSON, plus the metrics."""
    per: list[float] = []
    for _ in range(5):
        rec = recorder_for(Capture("cost"))
        reqs = [finished_request(i, str(uuid.uuid4())) for i in range(n)]
        t0 = time.perf_counter()
        for facts, meter, started in reqs:
            rec.finish(facts, meter.facts(ended=True), started)
        per.append((time.perf_counter() - t0) / n * 1e6)
    t0 = time.perf_counter()
    for i in range(n):
        finished_request(i, "x")
    setup = (time.perf_counter() - t0) / n * 1e6
    return {"finish_us": statistics.median(per), "finish_us_min": min(per),
            "request_state_us": setup, "samples": n}


# --------------------------------------------------------------------------- the spool


async def put_during_commit_breaks(root: Path) -> bool:
    """Regression guard for d8ac40e: a put() while the writer's fsync is in flight used to
    fail an assertion and leave the spool wedged (every later put failed too)."""
    spool = Spool(root, "probe").open()
    writer = asyncio.create_task(spool.run_writer())
    try:
        spool.put(spool.next_seq(), b'{"seq":1}')
        deadline = time.monotonic() + 5
        while spool._queue and time.monotonic() < deadline:
            await asyncio.sleep(0)
        # the writer took the batch and durable_seq moves only when the loop next runs the
        # writer, so without awaiting here, its fsync is in flight now
        if spool.durable_seq != 0:
            return False
        try:
            spool.put(spool.next_seq(), b'{"seq":2}')
        except AssertionError:
            return True
        deadline = time.monotonic() + 5
        while spool.durable_seq < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return spool.durable_seq != 2 or len(spool.read_batch()) != 2
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        spool.close()


# --------------------------------------------------------------------------- one run


@dataclass
class Probe:
    """Counters wrapped around one spool and its producer."""

    commits: int = 0  # commit() calls (some find the queue empty)
    fsync_batches: list[int] = field(default_factory=list)  # lines per append (one fsync)
    produce_batches: list[int] = field(default_factory=list)
    durable_at: list[tuple[int, float]] = field(default_factory=list)  # (durable_seq, t)
    delivered_at: list[tuple[int, float]] = field(default_factory=list)
    all_delivered: asyncio.Event = field(default_factory=asyncio.Event)


def instrument(spool: Spool, producer: KafkaProducer, n: int) -> Probe:
    probe = Probe()
    commit, append, mark = spool.commit, spool.files.append, spool.mark_delivered
    send = producer.send_batch

    # *args/**kw: these wrap the gateway's methods, whose signatures may grow
    async def counted_commit(*args: Any, **kw: Any) -> None:
        probe.commits += 1
        await commit(*args, **kw)
        probe.durable_at.append((spool.durable_seq, time.perf_counter()))

    def counted_append(first: int, data: bytes, *args: Any, **kw: Any) -> None:
        probe.fsync_batches.append(data.count(b"\n"))  # list.append is atomic: in a thread
        append(first, data, *args, **kw)

    def counted_mark(seq: int, *args: Any, **kw: Any) -> None:
        mark(seq, *args, **kw)
        probe.delivered_at.append((seq, time.perf_counter()))
        if seq >= n:
            probe.all_delivered.set()

    async def counted_send(records: list[Record], *args: Any, **kw: Any) -> None:
        probe.produce_batches.append(len(records))
        await send(records, *args, **kw)

    spool.commit = counted_commit  # type: ignore[method-assign]
    spool.files.append = counted_append  # type: ignore[method-assign]
    spool.mark_delivered = counted_mark  # type: ignore[method-assign]
    producer.send_batch = counted_send  # type: ignore[method-assign]
    return probe


def lags_ms(put_at: list[float], marks: list[tuple[int, float]]) -> dict[str, float]:
    """Per event: time from put() to the first mark covering its seq (seq is 1-based)."""
    out: list[float] = []
    prev = 0
    for seq, t in sorted(marks):
        for s in range(prev + 1, seq + 1):
            out.append((t - put_at[s - 1]) * 1000)
        prev = max(prev, seq)
    return pct_summary(out)


def pct_summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, max(0, int(p / 100 * len(s) + 0.999999) - 1))]

    return {"p50": pct(50), "p99": pct(99), "max": s[-1], "mean": sum(s) / len(s)}


async def until_delivered(probe: Probe, tasks: list[asyncio.Task[Any]], timeout_s: float,
                          ) -> None:
    """Wait for the last delivery mark; a task that dies (e.g. the shipper) fails at once."""
    done_wait = asyncio.ensure_future(probe.all_delivered.wait())
    pending = {done_wait, *tasks}
    deadline = time.monotonic() + timeout_s
    try:
        while not done_wait.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not all delivered within {timeout_s:.0f} s")
            done, pending = await asyncio.wait(pending, timeout=left,
                                               return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not done_wait and t.exception() is not None:
                    raise RuntimeError(f"task {t.get_name()} died") from t.exception()
    finally:
        done_wait.cancel()


async def run_variant(name: str, instance: str, root: Path, producer: KafkaProducer, n: int,
                      prebuilt: bool, timeout_s: float) -> tuple[dict[str, Any], list[str]]:
    spool = Spool(root, f"bench-{instance}".replace("+", "-").replace(" ", "-")).open()
    ids = [str(uuid.uuid4()) for _ in range(n)]
    lines: list[bytes] = []
    if prebuilt:
        capture = Capture(spool.instance_id)
        rec = recorder_for(capture)
        for i, eid in enumerate(ids):
            emit(rec, i, eid)
        lines = capture.lines
    recorder = recorder_for(spool)
    probe = instrument(spool, producer, n)
    put_at: list[float] = []
    appended_at = 0.0

    async def appender() -> None:
        nonlocal appended_at
        for i in range(n):
            if prebuilt:
                spool.put(spool.next_seq(), lines[i])
            else:
                emit(recorder, i, ids[i])
            put_at.append(time.perf_counter())
            await asyncio.sleep(0)
        appended_at = time.perf_counter()

    writer = asyncio.create_task(spool.run_writer(), name="writer")
    shipper = asyncio.create_task(Shipper(spool, producer).run(), name="shipper")
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        app = asyncio.create_task(appender(), name="appender")
        await until_delivered(probe, [app, writer, shipper], timeout_s)
        await app
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        for task in (writer, shipper):
            task.cancel()
        await asyncio.gather(writer, shipper, return_exceptions=True)
        spool.close()
    fs = probe.fsync_batches
    pb = probe.produce_batches
    result = {
        "variant": name, "n": n, "prebuilt": prebuilt,
        "wall_s": wall, "cpu_s": cpu, "cpu_util": cpu / wall,
        "events_per_s": n / wall, "events_per_cpu_s": n / cpu,
        "cpu_us_per_event": cpu / n * 1e6,
        "append_done_s": appended_at - t0,
        "commit_calls": probe.commits,
        "fsyncs": len(fs), "fsync_batch_mean": sum(fs) / len(fs) if fs else 0.0,
        "fsync_batch_max": max(fs, default=0), "fsyncs_per_s": len(fs) / wall,
        "produce_batches": len(pb), "produce_batch_mean": sum(pb) / len(pb) if pb else 0.0,
        "produce_batch_max": max(pb, default=0),
        "lag_put_to_durable_ms": lags_ms(put_at, probe.durable_at),
        "lag_put_to_delivered_ms": lags_ms(put_at, probe.delivered_at),
        "delivered": spool.delivered, "durable": spool.durable_seq,
    }
    return result, ids


async def warm_up(root: Path, producer: KafkaProducer, timeout_s: float = 30.0) -> None:
    """Connect, learn metadata and create the topic (first sends may fail and be retried)."""
    spool = Spool(root, "bench-warmup").open()
    rec = recorder_for(spool)
    for i in range(200):
        emit(rec, i, f"warmup-{i}")
    writer = asyncio.create_task(spool.run_writer())
    shipper = asyncio.create_task(Shipper(spool, producer).run())
    try:
        deadline = time.monotonic() + timeout_s
        while spool.delivered < 200:
            if time.monotonic() > deadline:
                raise TimeoutError("warm-up: the broker never acknowledged 200 events")
            await asyncio.sleep(0.05)
    finally:
        for task in (writer, shipper):
            task.cancel()
        await asyncio.gather(writer, shipper, return_exceptions=True)
        spool.close()


async def read_back(bootstrap: str, want: dict[str, set[str]], timeout_s: float,
                    ) -> dict[str, Any]:
    """Read the topic from the beginning until every wanted id is seen (or timeout)."""
    total_want = sum(len(v) for v in want.values())
    owner = {eid: name for name, ids in want.items() for eid in ids}
    seen: dict[str, set[str]] = {name: set() for name in want}
    messages = matched = 0

    def keep(m: Any) -> bool:
        nonlocal messages, matched
        messages += 1
        key = (m.key or b"").decode()
        name = owner.get(key)
        if name is not None:
            matched += 1
            seen[name].add(key)
        return True

    t0 = time.perf_counter()
    # all there, then one more quiet poll so that trailing duplicates would show
    await read_topic(bootstrap, keep, lambda: sum(len(v) for v in seen.values()) >= total_want,
                     timeout=timeout_s, max_records=50_000, max_partition_fetch_bytes=8 << 20,
                     fetch_max_bytes=64 << 20)
    per = {name: {"wanted": len(want[name]), "distinct_seen": len(seen[name]),
                  "missing": len(want[name] - seen[name])} for name in want}
    distinct = sum(len(v) for v in seen.values())
    return {"per_variant": per, "messages_read": messages, "matched": matched,
            "duplicates": matched - distinct, "read_s": time.perf_counter() - t0,
            "ok": all(p["missing"] == 0 for p in per.values())}


# --------------------------------------------------------------------------- reporting


def fs_type(path: Path) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip()
    return ""


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, _ in VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        if mine:
            out[name] = {k: statistics.median(r[k] for r in mine) for k in (
                "events_per_s", "events_per_cpu_s", "cpu_us_per_event", "fsync_batch_mean",
                "fsyncs_per_s", "produce_batch_mean")}
            out[name]["runs"] = len(mine)
    return out


def table(rows: list[dict[str, Any]], cost: dict[str, float]) -> str:
    head = ("variant", "round", "N", "wall s", "ev/s", "ev/cpu-s", "cpu µs/ev", "cpu%", "fsyncs",
            "ev/fsync", "fsync/s", "kafka batches", "ev/batch", "durable p50/p99 ms",
            "delivered p50/p99 ms")
    body = []
    for r in rows:
        d, v = r["lag_put_to_durable_ms"], r["lag_put_to_delivered_ms"]
        body.append((
            r["variant"], str(r.get("round", 0)), f"{r['n']:,}", f"{r['wall_s']:.2f}",
            f"{r['events_per_s']:,.0f}",
            f"{r['events_per_cpu_s']:,.0f}", f"{r['cpu_us_per_event']:.0f}",
            f"{r['cpu_util'] * 100:.0f}", f"{r['fsyncs']:,}", f"{r['fsync_batch_mean']:.1f}",
            f"{r['fsyncs_per_s']:.0f}", f"{r['produce_batches']:,}",
            f"{r['produce_batch_mean']:.0f}",
            f"{d.get('p50', 0):.1f} / {d.get('p99', 0):.1f}",
            f"{v.get('p50', 0):.1f} / {v.get('p99', 0):.1f}"))
    out = markdown_table(head, body)
    for name, m in medians(rows).items():
        out.append(f"median of {m['runs']:.0f} {name}: {m['events_per_s']:,.0f} events/s wall, "
                   f"{m['events_per_cpu_s']:,.0f} events per CPU-second "
                   f"({m['cpu_us_per_event']:.0f} µs/event), {m['fsync_batch_mean']:.1f} "
                   f"events per fsync, {m['produce_batch_mean']:.0f} per Kafka batch")
    out.append(f"Recorder.finish alone (event + JSON + metrics, into a list): "
               f"{cost['finish_us']:.1f} µs median (min {cost['finish_us_min']:.1f}); "
               f"making the request state it reads (in build+ship, untimed here): "
               f"{cost['request_state_us']:.1f} µs")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def pin_self() -> dict[str, Any]:
    cpus = os.sched_getaffinity(0)
    if not {BENCH_CPU, BROKER_CPU} <= cpus:
        return {"pinned": False, "cpus_available": sorted(cpus)}
    os.sched_setaffinity(0, {BENCH_CPU})  # threads started later (to_thread) inherit it
    return {"pinned": True, "bench_cpu": BENCH_CPU, "broker_cpu": BROKER_CPU}


async def bench(args: argparse.Namespace, bootstrap: str, root: Path) -> dict[str, Any]:
    producer = KafkaProducer(bootstrap, USAGE_TOPIC, idempotence=False)
    rows: list[dict[str, Any]] = []
    want: dict[str, set[str]] = {}
    if await put_during_commit_breaks(root):
        raise SystemExit("gateway.sinks.spool: a put() while a group commit is in flight "
                         "fails or loses the line (the bug fixed in d8ac40e is back)")
    try:
        await warm_up(root, producer)
        variants = [(name, prebuilt) for name, prebuilt in VARIANTS
                    if not args.only or name in args.only]
        for rnd in range(args.rounds):
            for name, prebuilt in variants if rnd % 2 == 0 else variants[::-1]:
                r, ids = await run_variant(name, f"{name}-r{rnd}", root, producer, args.n,
                                           prebuilt, args.timeout)
                r["round"] = rnd
                rows.append(r)
                want[f"{name} r{rnd}"] = set(ids)
                print(f"  round {rnd} {name}: {r['events_per_s']:,.0f} events/s, "
                      f"{r['cpu_us_per_event']:.0f} cpu µs/event, "
                      f"{r['fsync_batch_mean']:.1f} events/fsync", flush=True)
    finally:
        await producer.close()
    check = await read_back(bootstrap, want, timeout_s=60.0)
    return {"rows": rows, "read_back": check}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N=10k, under a minute")
    parser.add_argument("-n", type=int, default=None, help="events per variant")
    parser.add_argument("--out", default=str(HERE / "results" / "spool.json"))
    parser.add_argument("--dir", default=None, help="parent of the temporary spool/work dir")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--no-uvloop", action="store_true",
                        help="plain asyncio loop (the sidecar runs uvloop)")
    parser.add_argument("--only", action="append", choices=[v for v, _ in VARIANTS])
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs of each variant, alternating order (quick 1, full 3)")
    parser.add_argument("--timeout", type=float, default=None, help="per variant, seconds")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args()
    args.n = args.n or (10_000 if args.quick else 100_000)
    args.timeout = args.timeout or (25.0 if args.quick else 90.0)
    args.rounds = args.rounds or (1 if args.quick else 3)

    placement = {"pinned": False} if args.no_pin else pin_self()
    loadavg_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-spool-", dir=args.dir))
    broker: Service | None = None
    started = time.time()
    try:
        cost = build_cost_us(5_000 if args.quick else 20_000)
        broker = tansu_service(free_port(), workdir).start()
        if placement.get("pinned"):
            pin(broker.pid, {BROKER_CPU})
        print(f"tansu on {broker.address}; N={args.n:,} per variant; {placement}", flush=True)
        coro = bench(args, broker.address, workdir / "spool")
        if args.no_uvloop:
            result = asyncio.run(coro)
            loop_name = "asyncio"
        else:
            import uvloop

            result = uvloop.run(coro)
            loop_name = f"uvloop {uvloop.__version__}"
    finally:
        if broker is not None:
            broker.stop()
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(table(result["rows"], cost))
    rb = result["read_back"]
    verdict = "OK" if rb["ok"] and rb["duplicates"] == 0 else "FAILED"
    print(f"read back from Kafka: {verdict}: "
          + ", ".join(f"{k}: {v['distinct_seen']:,}/{v['wanted']:,} distinct event_ids"
                      for k, v in rb["per_variant"].items())
          + f"; duplicates {rb['duplicates']}; {rb['messages_read']:,} messages read "
          f"in {rb['read_s']:.1f} s")
    result["medians"] = medians(result["rows"])
    for name, m in result["medians"].items():
        ok = m["events_per_s"] >= TARGET_EVENTS_PER_S
        print(f"target >= {TARGET_EVENTS_PER_S:,} events/s ({name}, median): "
              f"{'met' if ok else 'NOT met'} ({m['events_per_s']:,.0f})")

    doc = {
        "bench": "spool", "mode": "quick" if args.quick else "full",
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_s": time.time() - started,
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "build_cost": cost, **result,
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                    "platform": platform.platform(), "loop": loop_name,
                    "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
                    "spool_fs": fs_type(workdir.parent), **placement},
        "git": git_state(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
