"""wrk, the HTTP load generator, as the Envoy scenarios drive it: a Lua script that counts
non-2xx answers and prints one JSON line, and one timed run of it with the CPU it cost."""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Any

from common import proc_cpu_s

LOOP = "127.0.0.1"
WRK_MAX_REQUESTS = 2_000_000  # per wrk thread: a count bound on top of wrk's time bound


WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {secret}"
local threads = {{}}
function setup(thread)
  table.insert(threads, thread)
end
n = 0
bad = ""
first_bad = ""
response = function(status, headers, body)
  n = n + 1
  if status < 200 or status > 299 then
    bad = bad .. status .. ","
    if first_bad == "" then first_bad = status .. " " .. string.sub(body or "", 1, 300) end
  end
  if n >= {max_requests} then wrk.thread:stop() end
end
done = function(summary, latency, requests)
  local e = summary.errors
  local statuses, first = "", ""
  for _, t in ipairs(threads) do
    statuses = statuses .. (t:get("bad") or "")
    if first == "" then first = t:get("first_bad") or "" end
  end
  io.write(string.format(
    'WRKJSON {{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,' ..
    '"mean_us":%f,"min_us":%d,"bad_statuses":"%s"}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    latency.mean, latency.min, statuses))
  io.write("WRKFIRSTBAD " .. string.gsub(first, "\\n", " ") .. "\\n")
end
"""


def run_wrk(script: Path, port: int, conc: int, duration_s: int, cpus: set[int] | None,
            cpu_pids: dict[str, int | None]) -> dict[str, Any]:
    argv = ["wrk", "-t1", f"-c{conc}", f"-d{duration_s}s", "--timeout", "5s", "-s", str(script),
            f"http://{LOOP}:{port}/v1/chat/completions"]
    if cpus and shutil.which("taskset"):
        argv = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *argv]
    before = {k: proc_cpu_s(p) for k, p in cpu_pids.items()}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 30,
                          start_new_session=True)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    after = {k: proc_cpu_s(p) for k, p in cpu_pids.items()}
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout}\n{done.stderr}")
    w = json.loads(line.removeprefix("WRKJSON "))
    elapsed = w["duration_us"] / 1e6
    kinds = {k: w[k] for k in ("connect", "read", "write", "timeout") if w[k]}
    for status in filter(None, w["bad_statuses"].split(",")):  # non-2xx, by status code
        kinds[f"status:{status}"] = kinds.get(f"status:{status}", 0) + 1
    first_bad = next((ln.removeprefix("WRKFIRSTBAD ").strip() for ln in done.stdout.splitlines()
                      if ln.startswith("WRKFIRSTBAD ")), "")
    return {
        "calls": w["requests"], "elapsed_s": elapsed, "rps": w["requests"] / elapsed,
        "errors": sum(kinds.values()), "error_kinds": kinds, "first_error": first_bad,
        "latency": {"p50_ms": w["p50_us"] / 1e3, "p90_ms": w["p90_us"] / 1e3,
                    "p99_ms": w["p99_us"] / 1e3, "max_ms": w["max_us"] / 1e3,
                    "mean_ms": w["mean_us"] / 1e3, "min_ms": w["min_us"] / 1e3},
        "cpu_s": {k: after[k] - b for k, b in before.items()  # type: ignore[operator]
                  if b is not None and after[k] is not None},
        "loadgen_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
        "capped": w["requests"] >= WRK_MAX_REQUESTS,
    }


def wrk_version() -> str:
    """`wrk --version`'s first line ('' without wrk)."""
    if shutil.which("wrk"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["wrk", "--version"], capture_output=True, text=True, timeout=5)
            return (out.stdout or out.stderr).splitlines()[0]
    return ""
