"""Helpers every benchmark shares: the commit and machine measured, an older revision's tree
to run beside this one (--baseline), CPU accounting, CPU pinning, the processes a bench
started, its tables."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from devspoke.procs import Service

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def positive_int(text: str) -> int:
    """argparse type: an int of at least 1 (--envoy-workers)."""
    n = int(text)
    if n < 1:
        raise ValueError(text)  # argparse: "invalid positive_int value"
    return n


def envoy_flags(parser: argparse.ArgumentParser, flush_note: str = "") -> None:
    """--records-flush-ms and --envoy-workers, as every bench that starts a spoke takes them
    (the Envoy settings an operator can change: `gateway envoy-config`, Envoy's own flag)."""
    from gateway.envoy_contract import RECORDS_FLUSH_MS
    parser.add_argument("--records-flush-ms", type=float, default=float(RECORDS_FLUSH_MS),
                        help="how often the spoke's Envoy sends its records (default: "
                             f"%(default)g, `gateway envoy-config`'s{flush_note})")
    parser.add_argument("--envoy-workers", type=positive_int, default=1,
                        help="worker threads of every Envoy of the run, plain and spokes' "
                             "(Envoy's --concurrency; default: %(default)s)")


def envoy_stats(admin_port: int, prefix: str, timeout: float = 5.0) -> dict[str, int]:
    """An Envoy's counters and gauges whose names start with `prefix`, the prefix cut off
    (its admin /stats; histograms left out)."""
    url = f"http://127.0.0.1:{admin_port}/stats?filter=^{re.escape(prefix)}"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        lines = resp.read().decode().splitlines()
    out = {}
    for line in lines:
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name.removeprefix(prefix)] = int(value)
    return out


def git_state() -> dict[str, Any]:
    """The commit measured, and the files that differed from it (others may edit meanwhile)."""
    def git(*argv: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                                 timeout=10)
            if out.returncode == 0:
                return out.stdout
        return ""

    return {"commit": git("rev-parse", "HEAD").strip(),
            "modified": [ln[3:] for ln in git("status", "--porcelain").splitlines()
                         if not ln[3:].startswith("benchmarks/")]}


@dataclass(frozen=True)
class Baseline:
    """Git revision `rev` unpacked into `tree` (git archive: no worktree to clean up, nothing
    of this checkout's state). `env` runs the gateway of that revision: its package first on
    sys.path, and PYTHONSAFEPATH so that the cwd's (this checkout's) `gateway` cannot win."""

    rev: str
    tree: Path
    describe: str  # "<short hash> <subject>"

    @property
    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(self.tree), "PYTHONSAFEPATH": "1"}

    def gateway(self, *argv: str) -> str:
        """`python -m gateway ARGV...` of that revision; its stdout."""
        return subprocess.run([sys.executable, "-m", "gateway", *argv], check=True,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, **self.env}).stdout


def baseline_tree(rev: str, dest: Path) -> Baseline:
    """Unpack revision `rev` of this repository into `dest` (created; must not exist)."""
    describe = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s", rev],
                              check=True, capture_output=True, text=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return Baseline(rev, dest, describe)


def proc_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process (all threads) and of its reaped children, in seconds."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2:].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLK_TCK


def pin(pid: int | None, cpus: set[int] | None) -> None:
    """Pin every thread of `pid` (threads started later inherit their creator's mask)."""
    if pid is None or not cpus:
        return
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


def split_cpus(enabled: bool = True) -> tuple[set[int] | None, set[int] | None]:
    """(servers' CPUs, load generator's CPUs): the first and second available CPU, so the
    client does not steal the servers' core; (None, None) with fewer than two or not enabled."""
    avail = sorted(os.sched_getaffinity(0))
    if enabled and len(avail) >= 2:
        return {avail[0]}, {avail[1]}
    return None, None


class Processes:
    """The services a bench started: each pinned once it is up, all stopped at the end,
    newest first, even after a failure."""

    def __init__(self) -> None:
        self.services: list[Service] = []

    def start(self, svc: Service, cpus: set[int] | None) -> Service:
        self.services.append(svc)
        svc.start()
        pin(svc.pid, cpus)
        return svc

    def start_all(self, svcs: list[Service], cpus: set[int] | None) -> list[Service]:
        """Start `svcs` at once (each start waits for its port: the waits overlap), each
        pinned once it is up; the first failure is raised once all have tried."""
        self.services += svcs

        def up(svc: Service) -> None:
            svc.start()
            pin(svc.pid, cpus)

        together(*(lambda s=svc: up(s) for svc in svcs))
        return svcs

    def stop(self) -> None:
        for svc in reversed(self.services):
            with contextlib.suppress(Exception):
                svc.stop()


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run `calls` in threads at once (service starts that each wait for a port, a spoke's
    whole start); their results in order, or the first exception once all have ended."""
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
        wait(futures)
    return [f.result() for f in futures]


def sched_ns(pid: int | None) -> tuple[int, int, int] | None:
    """(on-CPU ns, waiting-for-a-CPU ns) summed over the live threads of `pid`, and the main
    thread's wait, from /proc/<pid>/task/*/schedstat: the run-queue wait shows CPU
    contention directly (for the sidecar the main thread is the event loop)."""
    if pid is None:
        return None
    run = wait = main_wait = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                a, b, _ = f.read().split()
            run += int(a)
            wait += int(b)
            if tid == str(pid):
                main_wait = int(b)
    return run, wait, main_wait


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (a sidecar's workers), from /proc's parent ids."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), \
                    open(f"/proc/{entry}/stat", "rb") as f:
                parent[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return found


def tree_sched_ns(pid: int | None) -> tuple[int, int, int] | None:
    """sched_ns summed over `pid` and its descendants (the main thread's wait: `pid`'s)."""
    if pid is None:
        return None
    parts = [x for x in map(sched_ns, descendants(pid)) if x is not None]
    if not parts:
        return None
    return sum(x[0] for x in parts), sum(x[1] for x in parts), parts[0][2]


def listening_pids(port: int) -> set[int]:
    """The processes holding a TCP socket that listens on `port` (IPv4, /proc/net/tcp)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                            pids.add(int(entry))
                            break
    return pids


DOOR_CPU = ("free", "same", "other")  # where a bench puts GATEWAY_DOOR_WORKERS' processes


def pin_sidecar(pid: int | None, cpus: set[int], door: str | None, door_cpu: str,
                other: set[int]) -> None:
    """Pin a sidecar and its workers to `cpus`; its door workers (the processes listening on
    `door`, with GATEWAY_DOOR_WORKERS) to `cpus` ("same"), `other`, or both ("free": the
    kernel decides)."""
    if pid is None:
        return
    for p in descendants(pid):
        pin(p, cpus)
    if door is None:
        return
    doors = listening_pids(int(door.rsplit(":", 1)[1])) - {pid}
    for p in doors:
        pin(p, {"free": cpus | other, "same": cpus, "other": other}[door_cpu])


def runs(pid: int | None) -> int | None:
    """How many times the threads of `pid` were put on a CPU (schedstat's third field, over
    the live threads): its wake-ups, each of which costs a cold cache and a switch."""
    if pid is None:
        return None
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    n = 0
    for tid in tids:
        with contextlib.suppress(OSError, ValueError), \
                open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            n += int(f.read().split()[2])
    return n


def scan_log(path: Path, start: int) -> dict[str, Any]:
    """Tracebacks and error lines in a service's log from byte `start` on."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return {}
    lines = text.splitlines()
    tb = [i for i, ln in enumerate(lines) if ln.startswith("Traceback")]
    errors = [ln for ln in lines if "AssertionError" in ln or '"level": "error"' in ln
              or "level=error" in ln]
    return {"tracebacks": len(tb), "error_lines": len(errors),
            "first_traceback": "\n".join(lines[tb[0]:tb[0] + 30]) if tb else "",
            "error_sample": errors[:3]}


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def machine_info(**extra: Any) -> dict[str, Any]:
    """The machine and its load, for the JSON (`extra` appended: the bench's placement)."""
    return {"nproc": os.cpu_count(), "cpus_available": len(os.sched_getaffinity(0)),
            "cpu_model": cpu_model(), "python": sys.version.split()[0],
            "platform": platform.platform(), **extra}


def markdown_table(head: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    """Lines of a Markdown table: first column left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                                 ) + " |"

    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *(line(row) for row in body)]
