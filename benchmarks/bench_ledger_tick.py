"""What one renewal tick of the ledger costs the sidecar's event loop, this tree against an
older revision's ledger, in the same process and the same run.

    .venv/bin/python benchmarks/bench_ledger_tick.py [--live 5000,50000] [--rounds 3]
        [--fresh 100] [--meter] [--baseline 40e132a] [--quick] [--out FILE]

Every tick of the renewal loop runs on the event loop, so while it runs every Check waits.
Here `--live` begun streams are followed (lease TTL 30 s, start TTL 5 s: the defaults, so
a round of everyone comes every 6th tick), and each tick `--fresh` streams begin and as
many end. The loop itself runs, with its `asyncio.sleep` replaced by one that advances a
fake clock by a tick, applies that churn and yields: what is timed is the loop's work from
one wakeup to its next sleep, against a store whose renew returns at once (the store's own
time is bench_renew's). Each revision's `gateway/limits/ledger.py` is loaded from its
source (this tree's from disk, the baseline's from `git show`) and both run in
alternating order within each round. Per tick kind (fresh only, everyone), the median of
the ticks' whole time and of the longest the tick held the event loop at once (a probe
task runs at every turn of the loop: the longest gap between two of its runs).

Each stream's checkpoint (its usage so far, read at each renewal) is a constant, or with
`--meter` a real `Meter.checkpoint` of its own, as the ext_proc source gives the ledger:
a round of everyone reads every one of them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import ROOT, git_state, machine_info, markdown_table

from gateway.clock import FakeClock
from gateway.metering.meter import Meter

LEASE_TTL, START_TTL = 30.0, 5.0  # gateway/settings.py's defaults
SOURCE = "gateway/limits/ledger.py"


def load(rev: str | None) -> types.ModuleType:
    """The ledger module of revision `rev` (None: this tree), under its own name."""
    if rev is None:
        src, name = (ROOT / SOURCE).read_text(), "this tree"
    else:
        src = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        name = rev
    mod = types.ModuleType(f"ledger_{abs(hash(name))}")
    exec(compile(src, f"{name}:{SOURCE}", "exec"), mod.__dict__)
    mod.__dict__["label"] = name
    return mod


class Store:
    """A store that renews at once and ends nothing: only the ledger's own time is left."""

    def __init__(self) -> None:
        self.calls: list[int] = []  # ids per renew call

    async def renew(self, ids: Sequence[str], now: float,
                    checkpoints: dict[str, tuple[int, int]] | None = None) -> list[str]:
        self.calls.append(len(ids))
        return []

    async def end_many(self, ends: Sequence[Any]) -> None:
        return None


def constant() -> tuple[int, int]:
    return (120, 40)


def progress(meter: bool) -> Callable[[], tuple[int, int] | None]:
    """A stream's checkpoint: a constant, or a Meter's 60 events into an SSE answer."""
    if not meter:
        return constant
    m = Meter("/v1/chat/completions", True, prompt_estimate=120, status=200, sse=True,
              content_events=60, content_chars=400)
    return m.checkpoint


async def one_run(mod: types.ModuleType, live: int, fresh: int, ticks: int,
                  meter: bool) -> dict[str, float]:
    """`ticks` ticks after a warm-up cycle; the median ms of each kind of tick."""
    clock, store = FakeClock(), Store()
    ledger = mod.Ledger(store, clock, LEASE_TTL, START_TTL)
    every = round(ledger.renew_every / ledger.tick)
    for i in range(live):
        ledger.begun(f"s{i}", progress(meter))
    born, oldest = live, 0
    times: list[tuple[float, float, int]] = []  # (seconds, longest hold, ids renewed) a tick
    woke: list[float] = []
    ran = [0.0, 0.0]  # when the probe last ran; the longest hold since the tick woke
    done = asyncio.Event()
    real_sleep = asyncio.sleep

    async def probe() -> None:
        """Runs at every turn of the event loop: what else waits, a Check would."""
        while True:
            await real_sleep(0)
            t = time.perf_counter()
            ran[1], ran[0] = max(ran[1], t - ran[0]), t

    async def sleep(delay: float) -> None:
        nonlocal born, oldest
        if delay == 0:  # a yield inside the tick, not the loop's sleep
            await real_sleep(0)
            return
        t = time.perf_counter()
        if woke:
            times.append((t - woke[-1], max(ran[1], t - ran[0]), sum(store.calls)))
            store.calls.clear()
        if len(times) >= ticks + every:
            done.set()
            await real_sleep(3600)
        for _ in range(fresh):  # streams beginning and ending between two ticks
            ledger.begun(f"s{born}", progress(meter))
            ledger.settled(f"s{oldest}", 10)
            born, oldest = born + 1, oldest + 1
        clock.advance(ledger.tick)
        await real_sleep(0)
        woke.append(time.perf_counter())
        ran[:] = [woke[-1], 0.0]

    shim = types.SimpleNamespace(**{k: getattr(asyncio, k) for k in dir(asyncio)
                                    if not k.startswith("_")})
    shim.sleep = sleep
    mod.asyncio = shim
    gc.collect()
    tasks = [asyncio.create_task(ledger._renew_loop()), asyncio.create_task(probe())]
    try:
        await done.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    measured = times[every:]  # after the first round of everyone (every stream fresh)
    # A round of everyone renews all `live`; a tick between rounds only the `fresh`.
    kinds = {"fresh": [(s, h) for s, h, n in measured if n <= fresh],
             "everyone": [(s, h) for s, h, n in measured if n > fresh]}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}
    out: dict[str, float] = {}
    for kind, got in kinds.items():
        out[f"{kind}_ms"] = statistics.median(s for s, _ in got) * 1000
        out[f"{kind}_hold_ms"] = statistics.median(h for _, h in got) * 1000
        out[f"{kind}_ticks"] = len(got)
    return out


async def run(lives: list[int], rounds: int, fresh: int, ticks: int, meter: bool,
              mods: list[types.ModuleType]) -> dict[str, dict[str, Any]]:
    per: dict[str, list[dict[str, float]]] = {}
    for r in range(rounds):
        for live in lives:
            for mod in (mods if r % 2 == 0 else mods[::-1]):
                got = await one_run(mod, live, fresh, ticks, meter)
                per.setdefault(f"{live} live, {mod.label}", []).append(got)
    return {k: {"live": int(k.split()[0]), "ledger": k.split(", ", 1)[1],
                **{m: statistics.median(x[m] for x in v) for m in v[0]},
                "per_round": v} for k, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--live", default="5000,50000", help="streams followed, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fresh", type=int, default=100, help="streams beginning (and ending) a tick")
    ap.add_argument("--ticks", type=int, default=36, help="ticks measured a run")
    ap.add_argument("--meter", action="store_true", help="real Meter checkpoints")
    ap.add_argument("--baseline", default="40e132a", help="the ledger to compare with")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1,000 live, one round")
    a = ap.parse_args()
    if a.quick:
        a.live, a.rounds, a.ticks = "1000", 1, 12
    lives = [int(x) for x in a.live.split(",")]
    mods = [load(a.baseline), load(None)]
    res = asyncio.run(run(lives, a.rounds, a.fresh, a.ticks, a.meter, mods))
    rows = []
    for live in lives:
        old, new = res[f"{live} live, {a.baseline}"], res[f"{live} live, this tree"]
        for kind, m in (("fresh only", "fresh"), ("everyone", "everyone")):
            rows.append((f"{live} live, {kind}",
                         *(f"{r[f'{m}_{x}']:.3f}" for x in ("ms", "hold_ms") for r in (old, new))))
    head = ("tick (median ms)", f"whole {a.baseline}", "whole this tree",
            f"longest hold {a.baseline}", "longest hold this tree")
    print("\n".join(markdown_table(head, rows)))
    if a.out:
        a.out.write_text(json.dumps({"results": res, "fresh_per_tick": a.fresh, "meter": a.meter,
                                     "baseline": a.baseline, "git": git_state(),
                                     "machine": machine_info()}, indent=2))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
