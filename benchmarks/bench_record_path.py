"""CPU per Envoy record on the sidecar's records path (GATEWAY_METERING=envoy), pure Python
against the same modules compiled with mypyc (issue 26), interleaved in one run.

    .venv/bin/python benchmarks/bench_record_path.py [--quick] [--records 2000] [--rounds 9]
        [--sets leaf,wide] [--build-dir /tmp/gateway-mypyc] [--no-compile]
        [--out benchmarks/results/record_path.json]

Every record of an Export batch runs on the event loop (gateway/server/records_service.py):
while a batch is read, the Checks wait. The records are built as Envoy renders them (the
attributes of envoy_contract.RECORD_ATTRIBUTES, the Check's metadata as JSON: the shape of
tests/unit/test_record.py), in a mix: chat streams with reported usage, non-streamed chats,
Anthropic streams with cache counts, streams the client cancelled, denials. Timed per
record (`time.process_time` over all the records of a pass, the best of 3 passes):

* `read+settle`: `record.read` of the attributes and `billing.settle` of its facts;
* `event_json`: the usage event's JSON, of events built beforehand;
* `emit`: `Recorder.emit` (the event, its times, cost, JSON, the spool's put, metrics, the
  ledger's release) into a real `Spool` in a temporary directory;
* `_one`: the whole `RecordsService._one` (read, settle, emit, dedup), the ledger holding
  each record's admission as the Check left it (watched);
* `export`: `RecordsService.export` over parsed batches of 40 records (the attributes' dict
  from the protobuf, `_one`, the batch's metrics), its wait for durability skipped: what a
  batch holds the event loop for.

Each variant runs in its own worker process: `pure` imports this tree's `gateway`; a
compiled set imports a copy of it (`--build-dir`/SET) in which mypyc compiled that set's
modules in place (the rest of the copy stays Python). The workers alternate within each
round, pinned to the same core, with the round's hash seed; `pure again` (not in --quick)
is the same tree once more, an A/A: the noise a ratio must beat. Without mypyc or a C
compiler only the pure tree runs. The build is reused while the tree's sources are
unchanged.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from common import ROOT, git_state, machine_info, markdown_table

PARTS = ("read+settle", "event_json", "emit", "_one", "export")
LEAF = ("gateway/metering/record.py", "gateway/metering/billing.py",
        "gateway/metering/facts.py", "gateway/metering/cost.py",
        "gateway/metering/cancel.py", "gateway/usage_event.py")
# Everything the records path runs of the gateway's own, the service and the spool included.
WIDE = (*LEAF, "gateway/metering/handoff.py", "gateway/metering/usage.py",
        "gateway/metering/inject.py", "gateway/endpoints.py", "gateway/envoy_contract.py",
        "gateway/policy/billing_rules.py", "gateway/policy/prices.py",
        "gateway/metering/recorder.py", "gateway/limits/ledger.py", "gateway/sinks/spool.py",
        "gateway/server/records_service.py")
SETS = {"leaf": LEAF, "wide": WIDE}
QUICK_SKIP = ("rich", "markdown_it", "mdurl")
BATCH = 40  # records in one Export at c=1 (50 ms of requests)
PASSES = 3

# --------------------------------------------------------------------------- the worker


def attrs_of(i: int, rid: str) -> dict[str, str]:
    """Record `i` of the mix, as Envoy's access logger renders it."""
    import orjson

    from gateway.metering import handoff

    shape = i % 10
    endpoint = "/v1/messages" if shape == 7 else "/v1/chat/completions"
    stream = shape not in (5, 6)
    md: dict[str, Any] = {
        **handoff.allowed(rid, 1200, 20 + i % 50),
        **handoff.caller("key-0042", "team-research", "qwen3-coder", endpoint, stream, True,
                         stream, stream, False)}
    prompt, completion = 20 + i % 50, 40 + i % 200
    usage: Any = {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion, "model": "qwen3-coder-2025"}
    counted: Any = {"content_events": completion, "content_chars": completion * 4,
                    "done": True} if stream else "-"
    flags, code = "-", "200"
    if shape == 7:  # Anthropic stream with the prompt cache
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "cache_read_input_tokens": 40, "cache_creation_input_tokens": 8,
                 "model": "claude-x"}
    elif shape == 8:  # the client left mid-stream: no usage, what streamed
        flags, usage = "DC", "-"
        counted = {"content_events": completion // 2, "content_chars": completion * 2}
    elif shape == 9:  # refused at the Check
        md = handoff.denied(rid, "rate_limited", 429, "key-0042", "team-research",
                            "qwen3-coder", endpoint)
        code, usage, counted = "429", "-", "-"
    start = 1_800_000_000 + i * 0.013
    raw: dict[str, Any] = {
        "rid": rid, "type": "DownstreamEnd", "path": endpoint, "code": code, "flags": flags,
        "details": "via_upstream", "start": f"{start:.6f}", "duration_us": "1500000",
        "total_ms": "1500", "ttft_us": "50000", "gen_us": "900000" if stream else "-",
        "authz": md, "usage": usage, "counted": counted}
    return {k: v if isinstance(v, str) else orjson.dumps(v).decode() for k, v in raw.items()}


def per_record_us(fn: Callable[[], object], n: int) -> float:
    """The best of PASSES passes of `fn` (all n records), in CPU µs per record."""
    best = float("inf")
    for _ in range(PASSES):
        gc.collect()
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def worker(n: int) -> dict[str, Any]:
    from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
    from gateway.clock import SystemClock
    from gateway.limits.ledger import Ledger
    from gateway.limits.memory import MemoryLimiter
    from gateway.metering import billing, record
    from gateway.metering.recorder import Recorder
    from gateway.policy.prices import Rates
    from gateway.server.records_service import RecordsService
    from gateway.sinks.spool import Spool
    from gateway.usage_event import event_json

    rates = Rates(1_700_000_000.0, 0.5, 0.05, 0.6, 2.0)
    tmp = Path(tempfile.mkdtemp(prefix="record_path_"))
    runs = iter(range(1_000_000))

    def fresh(admit: Iterable[str] = ()) -> RecordsService:
        """A service as the sidecar builds it, with a spool of its own; `admit`: the
        admissions its Checks left (watched, as with GATEWAY_METERING=envoy)."""
        spool = Spool(tmp / f"spool{next(runs)}", "bench").open()
        ledger = Ledger(MemoryLimiter(), SystemClock(), 30.0, watches=True)
        for rid in admit:
            ledger.admitted(rid)
        recorder = Recorder(spool, "bench", ledger, price=lambda model, at: rates)
        return RecordsService(recorder, ledger, settle_wait_s=0)  # no store to wait for

    def records(tag: str) -> list[dict[str, str]]:
        return [attrs_of(i, f"{tag}-{i:07d}") for i in range(n)]

    out: dict[str, Any] = {"modules": {m: getattr(sys.modules[m], "__file__", "") for m in (
        "gateway.metering.record", "gateway.usage_event", "gateway.metering.recorder",
        "gateway.server.records_service")}}
    us: dict[str, float] = {}
    base = records("base")

    def read_settle() -> None:
        for a in base:
            rec = record.read(a)
            assert rec is not None
            billing.settle(rec.facts, rec.response)

    us["read+settle"] = per_record_us(read_settle, n)

    capture = fresh()
    for a in base:
        capture._one(a)
    lines = capture.recorder.spool._queue
    assert len(lines) == n, "every record of the mix makes an event"
    out["event_bytes"] = round(statistics.mean(len(x) for x in lines))
    read_back = [record.read(a) for a in base]
    settled = [(r.facts, billing.settle(r.facts, r.response), r.started, r.ended)
               for r in read_back if r is not None]
    emitter = fresh()
    events = [emitter.recorder.emit(*s) for s in settled]
    us["event_json"] = per_record_us(lambda: [event_json(e) for e in events], n)

    def emit_all() -> None:
        recorder = fresh([f.request_id for f, *_ in settled]).recorder
        t0 = time.process_time()
        for s in settled:
            recorder.emit(*s)
        spent[0] += time.process_time() - t0

    def timed(setup_and_run: Callable[[], None]) -> float:
        """Like per_record_us, but only the part `setup_and_run` adds to `spent`."""
        best = float("inf")
        for _ in range(PASSES):
            gc.collect()
            spent[0] = 0.0
            setup_and_run()
            best = min(best, spent[0])
        return best / n * 1e6

    spent = [0.0]
    us["emit"] = timed(emit_all)

    def one_all() -> None:
        recs = records(f"one{next(runs)}")
        service = fresh([a["rid"] for a in recs])
        t0 = time.process_time()
        for a in recs:
            service._one(a)
        spent[0] += time.process_time() - t0

    us["_one"] = timed(one_all)

    def export_all() -> None:
        recs = records(f"exp{next(runs)}")
        service = fresh([a["rid"] for a in recs])
        # Its wait for durability returns at once (no patching: a compiled Spool has none).
        service.recorder.spool.durable_seq = 1 << 62
        batches = []
        for at in range(0, n, BATCH):
            req = otlp.ExportLogsServiceRequest()
            logs = req.resource_logs.add().scope_logs.add()
            for a in recs[at:at + BATCH]:
                lr = logs.log_records.add()
                for k, v in a.items():
                    kv = lr.attributes.add()
                    kv.key, kv.value.string_value = k, v
            batches.append(otlp.ExportLogsServiceRequest.FromString(req.SerializeToString()))
        t0 = time.process_time()
        for b in batches:  # no await in it suspends: run each coroutine to its end directly
            coro = service.export(b)
            try:
                coro.send(None)
            except StopIteration:
                pass
            else:
                raise AssertionError("export suspended")
        spent[0] += time.process_time() - t0

    us["export"] = timed(export_all)
    shutil.rmtree(tmp, ignore_errors=True)
    out["us"] = us
    return out


# --------------------------------------------------------------------------- the driver


def sources_hash() -> str:
    h = hashlib.sha256()
    for p in sorted((ROOT / "gateway").rglob("*.py")):
        h.update(str(p.relative_to(ROOT)).encode() + p.read_bytes())
    return h.hexdigest()[:16]


def mypyc_path() -> Path | None:
    found = shutil.which("mypyc") or str(Path(sys.executable).with_name("mypyc"))
    return Path(found) if Path(found).exists() else None


def build(name: str, modules: tuple[str, ...], root: Path, opt_level: int = 3,
          skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of this tree's `gateway` in root/name, `modules` compiled in place by mypyc
    with the C compiler at -O`opt_level` (reused while the sources are unchanged). `skip`:
    packages mypy does not follow into (Any to the compiled code)."""
    dest, stamp = root / name, sources_hash()
    mark = dest / "built.json"
    if mark.exists():
        info: dict[str, Any] = json.loads(mark.read_text())
        if (info.get("stamp") == stamp and info.get("modules") == list(modules)
                and info.get("opt_level", 3) == opt_level and info.get("skip", []) == list(skip)):
            return {**info, "reused": True}
    mypyc = mypyc_path()
    cc = shutil.which(os.environ.get("CC", "cc"))
    if mypyc is None or cc is None:
        return {"error": f"no {'mypyc' if mypyc is None else 'C compiler'} here"}
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copytree(ROOT / "gateway", dest / "gateway",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if skip:
        (dest / "mypy.ini").write_text("[mypy]\n" + "".join(
            f"[mypy-{pkg}.*]\nfollow_imports = skip\n" for pkg in skip))
    t0 = time.monotonic()
    proc = subprocess.run([str(mypyc), *modules], cwd=dest, capture_output=True, text=True,
                          env={**os.environ, "MYPYC_OPT_LEVEL": str(opt_level)})
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    info = {"stamp": stamp, "modules": list(modules), "opt_level": opt_level, "skip": list(skip),
            "build_s": round(time.monotonic() - t0, 1),
            "cc": subprocess.run([cc, "--version"], capture_output=True,
                                 text=True).stdout.splitlines()[0]}
    mark.write_text(json.dumps(info))
    return {**info, "reused": False}


def run_worker(path: Path, records: int, seed: int) -> dict[str, Any]:
    """One worker on the `gateway` at `path`. `seed`: the round's PYTHONHASHSEED, the same
    for every variant of a round (dict layouts differ between seeds, and so do timings)."""
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": os.pathsep.join(
        [str(path), str(ROOT)] if path != ROOT else [str(ROOT)])}
    proc = subprocess.run([sys.executable, __file__, "--worker", "--records", str(records)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 200 records, 1 round, the leaf set compiled at -O1")
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sets", default="leaf,wide", help=f"compiled sets: {', '.join(SETS)}")
    ap.add_argument("--build-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "gateway-mypyc")
    ap.add_argument("--no-compile", action="store_true", help="pure Python only")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "record_path.json")
    a = ap.parse_args()
    if a.worker:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:  # the same core for every worker (the lock keeps others off it)
            os.sched_setaffinity(0, {cpus[-1]})
        print(json.dumps(worker(a.records)))
        return 0
    records, rounds = (200, 1) if a.quick else (a.records, a.rounds)
    sets = [] if a.no_compile else ["leaf"] if a.quick else [
        s for s in a.sets.split(",") if s]
    variants: dict[str, Path] = {"pure": ROOT} if a.quick else {"pure": ROOT,
                                                                "pure again": ROOT}
    builds: dict[str, Any] = {}
    for name in sets:
        # --quick: the C compiler at -O1 (mypyc's default -O3 takes ~3 s longer on the leaf
        # set), and mypy does not read rich and markdown_it (127 modules pydantic's internals
        # import; the leaf set's generated C is byte-identical without them)
        builds[name] = build(name, SETS[name], a.build_dir, opt_level=1 if a.quick else 3,
                             skip=QUICK_SKIP if a.quick else ())
        if "error" in builds[name]:
            print(f"{name}: not compiled: {builds[name]['error']}")
        else:
            variants[f"mypyc {name}"] = a.build_dir / name
            b = builds[name]
            took = "reused" if b["reused"] else f"{b['build_s']} s"
            print(f"{name}: {len(SETS[name])} modules compiled at -O{b.get('opt_level', 3)} "
                  f"({took})")
    per_round: list[dict[str, Any]] = []
    modules: dict[str, Any] = {}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        got = {}
        for v in order:
            doc = run_worker(variants[v], records, seed=r + 1)
            got[v], modules[v] = doc["us"], doc["modules"]
        per_round.append(got)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{v} _one {got[v]['_one']:.1f} µs" for v in variants))
    for v, mods in modules.items():
        compiled = v.startswith("mypyc")
        wrong = [m for m, f in mods.items() if m == "gateway.metering.record"
                 and f.endswith(".so") != compiled]
        if wrong:
            raise SystemExit(f"{v}: {wrong} imported from {mods}")
    med = {v: {p: statistics.median(got[v][p] for got in per_round) for p in PARTS}
           for v in variants}
    head = ("µs per record", *variants, *(f"{v} / pure" for v in variants if v != "pure"))
    body = [(p, *(f"{med[v][p]:.1f}" for v in variants),
             *(f"{med[v][p] / med['pure'][p]:.2f}" for v in variants if v != "pure"))
            for p in PARTS]
    print(f"\n{records} records a pass, best of {PASSES} passes, median of {rounds} rounds")
    print("\n".join(markdown_table(head, body)))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "records": records, "rounds": rounds, "passes": PASSES, "batch": BATCH,
        "median_us": med, "per_round": per_round, "modules": modules, "builds": builds,
        "git": git_state(), "machine": machine_info()}, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
