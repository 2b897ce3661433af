"""The spool directory, one spool per instance: which one a starting instance takes, the
orphaned ones it adopts, and a read-only listing for the billing tools."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gateway.errors import SpoolLocked
from gateway.sinks.spool import Spool


def choose_instance(root: Path, configured: str) -> str:
    """The configured id, else a spool left by this host's previous run (its seq continues),
    else hostname-pid."""
    if configured:
        return configured
    host = socket.gethostname()
    for d in sorted(root.glob(f"{host}-*")) if root.exists() else []:
        probe = Spool(root, d.name)
        try:
            probe.open()
        except SpoolLocked:
            continue
        probe.close()
        return d.name
    return f"{host}-{os.getpid()}"


def orphans(root: Path, own: str) -> list[Spool]:
    """Other instances' spools with undelivered events whose owner is gone, opened (locked)."""
    found = []
    for d in sorted(root.iterdir()) if root.exists() else []:
        if not d.is_dir() or d.name == own:
            continue
        spool = Spool(root, d.name)
        try:
            spool.open()
        except SpoolLocked:
            continue
        if spool.depth > 0:
            found.append(spool)
        else:
            spool.close()
    return found


def spooled(root: Path) -> dict[str, tuple[int, int]]:
    """Per instance spool under `root`: (first undelivered seq, how many), read-only."""
    out = {}
    for d in sorted(root.iterdir()) if root.exists() else []:
        if d.is_dir():
            probe = Spool(root, d.name)
            probe._recover(repair=False)  # no lock: a live instance may own it; only read
            out[d.name] = (probe.delivered + 1, probe.depth)
    return out
