"""Where a Check's CPU goes: the real handler cut after each stage, under the same load.

    .venv/bin/python benchmarks/bench_stages.py [--quick] [--rounds N] [--concurrency C]
        [--out benchmarks/results/stages.json]

One `stage_server.py` per stage (floor, parse, authorize, answer, redis: see there), all
pinned to the same core, loaded in interleaved rounds by loadgen.py exactly as
bench_authz's direct scenarios are. Each row's CPU per Check minus the row above is what
that stage costs *inside the server*, which is 2-4x what the same Python costs in a
microbenchmark: it runs interleaved with gRPC's threads on one core.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from bench_authz import FULL, KEY_ID, QUICK, SMALL_BODY, policy_doc
from common import Processes, git_state, markdown_table, split_cpus
from loadgen_client import LoadGen
from stage_server import STAGES

from devspoke.procs import Service, free_port, redis_service
from devspoke.publish import publish
from gateway.policy import secrets
from testkit.check_requests import check_request

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 short round")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results" / "stages.json"))
    args = ap.parse_args()
    mode = QUICK if args.quick else FULL
    rounds = args.rounds or mode.rounds
    workdir = Path(tempfile.mkdtemp(prefix="bench-stages-"))
    server_cpus, load_cpus = split_cpus()
    procs = Processes()
    secret = secrets.new_secret(KEY_ID)
    loadgen: LoadGen | None = None
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STAGES}
    try:
        loadgen = LoadGen(load_cpus, workdir / "loadgen.log")
        redis = procs.start(redis_service(free_port(), workdir), load_cpus)
        redis_url = f"redis://{redis.address}/0"
        doc = policy_doc(secret, key_concurrency=None)
        publish(redis_url, doc, "bench")
        policy_file = workdir / "policy.yaml"
        policy_file.write_text(yaml.safe_dump(doc))
        servers = {}
        for stage in STAGES:
            port = free_port()
            argv = [sys.executable, str(HERE / "stage_server.py"), str(port), stage,
                    str(policy_file), redis_url]
            servers[stage] = Service(f"stage-{stage}", argv, port, workdir)
        procs.start_all(list(servers.values()), server_cpus)  # their start-ups overlap
        marker = str(uuid.uuid4())
        template = base64.b64encode(check_request(
            secret, body=SMALL_BODY, request_id=marker).SerializeToString()).decode()
        for rnd in range(rounds):
            for stage in STAGES if rnd % 2 == 0 else STAGES[::-1]:
                svc = servers[stage]
                job = {"kind": "grpc", "target": svc.address, "marker": marker,
                       "template_b64": template, "concurrency": args.concurrency,
                       "warmup_s": mode.warmup_s, "duration_s": mode.duration_s,
                       "max_calls": mode.max_calls, "cpu_pids": {"server": svc.pid}}
                result = loadgen.run(job, mode.warmup_s + mode.duration_s + 60)
                if result["errors"]:
                    raise RuntimeError(f"{stage}: {result['errors']} errors, first: "
                                       f"{result['first_error']}")
                runs[stage].append(result)
                print(f"  {stage:<10} {result['rps']:8.0f}/s", flush=True)
    finally:
        if loadgen is not None:
            loadgen.close()
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    rows, before = [], None
    for stage in STAGES:
        cpu = statistics.median(r["cpu_s"]["server"] / r["calls"] * 1e6 for r in runs[stage])
        rows.append({"stage": stage, "rps": statistics.median(r["rps"] for r in runs[stage]),
                     "cpu_us_per_check": cpu,
                     "added_us": None if before is None else cpu - before})
        before = cpu
    print()
    print("\n".join(markdown_table(
        ("stage", "checks/s", "CPU µs/check", "added by the stage µs"),
        [(r["stage"], f"{r['rps']:,.0f}", f"{r['cpu_us_per_check']:.0f}",
          "-" if r["added_us"] is None else f"{r['added_us']:+.0f}") for r in rows])))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "bench_stages", "mode": mode.name, "rounds": rounds,
        "concurrency": args.concurrency, "timestamp": time.time(), "rows": rows,
        "git": git_state()}, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
