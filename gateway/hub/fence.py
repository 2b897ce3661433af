"""Which of several `gateway hub allocate` may publish allowances (pure: no I/O, no clock).

Every allocator writes a heartbeat on `llm.quota.v1` every interval under its own key
`allocator/ID/heartbeat` (a spoke id never holds '/', so no allowance key `SPOKE` nor report
key `SPOKE/applied` is one, and neither this version's readers nor the previous one's take
it for either: docs/contracts.md §9), saying when it
started, its interval and whether it claims to be the active one. Each reads everyone's
heartbeats as it folds the topic, and decides with `Fence`:

* live: a heartbeat received (by the reader's own monotonic clock: no two hosts' clocks
  are compared for it) within `STALE_INTERVALS` of that allocator's own interval;
* the leader: the newest-started live allocator (start time, then id, as written: every
  reader ranks them alike). A rolling update's new allocator takes over at once;
* an allocator claims (`"state": "active"`) only while it is the leader, and withdraws at
  once (a `"standby"` heartbeat) when it reads a newer live one;
* it publishes only once its claim was written and it read the topic to its end after
  that, and no other live allocator claims there. Of two that claim at once, at least one
  reads the other's claim (each reads to an end taken after its own was acked), and the
  older withdraws; the newer waits for that withdrawal, written after the older's last
  allowance, then reads to the end again, so it continues the one generation sequence;
* an allocator whose own last heartbeat is older than `LEASE_INTERVALS` intervals (it
  cannot write) publishes nothing: by then the others may be about to count it gone.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREFIX, SUFFIX = "allocator/", "/heartbeat"  # two '/': never SPOKE/applied (spoke 'allocator')
STALE_INTERVALS = 3.0  # no heartbeat for this many of its intervals: gone
LEASE_INTERVALS = 2.0  # an allocator that wrote none for this long stops publishing itself


def new_id() -> str:
    host = socket.gethostname().replace("/", "_") or "host"  # the key holds no other '/'
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def heartbeat_key(allocator_id: str) -> bytes:
    return (PREFIX + allocator_id + SUFFIX).encode()


def parse_heartbeat_key(key: bytes | None) -> str | None:
    """The allocator id of a heartbeat key, or None (an allowance or a spoke's report)."""
    text = key.decode(errors="replace") if key else ""
    if not (text.startswith(PREFIX) and text.endswith(SUFFIX)) or text.count("/") != 2:
        return None
    return text[len(PREFIX):-len(SUFFIX)] or None


@dataclass(frozen=True)
class Heartbeat:
    id: str
    started: float  # unix time it started (ranks allocators: newest leads)
    interval_s: float
    active: bool  # it claims to be the one publishing allowances

    @classmethod
    def parse(cls, allocator_id: str, msg: Mapping[str, Any]) -> Heartbeat | None:
        try:
            hb = cls(allocator_id, float(msg["started"]), float(msg["interval_s"]),
                     msg.get("state") == "active")
        except (KeyError, TypeError, ValueError):
            return None
        return hb if hb.interval_s > 0 else None

    def message(self, leader: str | None, generation: int) -> dict[str, Any]:
        return {"kind": "allocator", "id": self.id, "started": self.started,
                "interval_s": self.interval_s,
                "state": "active" if self.active else "standby",
                "leader": leader, "generation": generation}

    def rank(self) -> tuple[float, str]:
        return self.started, self.id


class Fence:
    def __init__(self, me: Heartbeat) -> None:
        self.me = me
        self._others: dict[str, tuple[Heartbeat, float]] = {}  # id → (newest, received at)
        self._written_at: float | None = None  # when our last heartbeat was sent

    # --- what the topic says --------------------------------------------------------

    def on_heartbeat(self, allocator_id: str, msg: Mapping[str, Any] | None, now: float) -> None:
        """A heartbeat record read now (monotonic `now`); None (a tombstone): it stopped."""
        if allocator_id == self.me.id:
            return
        hb = Heartbeat.parse(allocator_id, msg) if msg is not None else None
        if hb is None:
            self._others.pop(allocator_id, None)
        else:
            self._others[allocator_id] = (hb, now)

    def wrote(self, sent_at: float) -> None:
        """Our heartbeat was acked; it was sent at `sent_at` (monotonic)."""
        self._written_at = sent_at

    # --- deciding -------------------------------------------------------------------

    def live(self, now: float) -> list[Heartbeat]:
        """The other allocators heard from recently enough."""
        return [hb for hb, at in self._others.values()
                if now - at <= STALE_INTERVALS * hb.interval_s]

    def leader(self, now: float) -> Heartbeat:
        return max([self.me, *self.live(now)], key=Heartbeat.rank)

    def leads(self, now: float) -> bool:
        return self.leader(now).id == self.me.id

    def claimants(self, now: float) -> list[Heartbeat]:
        """The other live allocators that claim to publish."""
        return [hb for hb in self.live(now) if hb.active]

    def leased(self, now: float) -> bool:
        """Our own heartbeat was written recently enough for us to publish."""
        return (self._written_at is not None
                and now - self._written_at < LEASE_INTERVALS * self.me.interval_s)

    def may_publish(self, now: float) -> bool:
        """We lead, no other live one claims, and our own heartbeat is recent. (The caller
        adds: our claim was written and the topic read to its end since.)"""
        return self.leads(now) and not self.claimants(now) and self.leased(now)
