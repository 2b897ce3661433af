"""Helpers every benchmark shares: the commit measured, CPU accounting, CPU pinning."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


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


def markdown_table(head: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    """Lines of a Markdown table: first column left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                                 ) + " |"

    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *(line(row) for row in body)]
