"""Whether new requests may be admitted as far as their usage is concerned: closed while the
spool cannot write (disk full, read-only, EIO), open again at its next successful group
commit. The Check reads `closed`, a plain attribute (no syscall, no lock); whoever owns the
state (the spool's writer, or in a door process the poll of the records processes' shared
flags, gateway/server/workers.py) calls `set`."""

from __future__ import annotations

from collections.abc import Callable


class UsageGate:
    __slots__ = ("closed", "listeners", "reason")

    def __init__(self) -> None:
        self.closed = False
        self.reason = ""  # why it is closed (the spool's error), for /readyz and the logs
        self.listeners: list[Callable[[bool], None]] = []  # told of each change

    def set(self, closed: bool, reason: str = "") -> bool:
        """Close or open it; True when that changed it (its listeners were told)."""
        if closed:
            self.reason = reason
        if closed == self.closed:
            return False
        self.closed = closed
        if not closed:
            self.reason = ""
        for fn in self.listeners:
            fn(closed)
        return True
