"""The last revision a syncer applied, kept on the spoke's disk in the feed's own format, so
a spoke whose Redis was wiped while the hub is away comes back serving it, not denying all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gateway.hub import feed
from gateway.log import log
from gateway.policy.loader import to_data
from gateway.policy.schema import PolicyDoc


class LastGood:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.raw: bytes | None = None  # the feed value {"revision", "policy"}
        self.revision = 0

    def load(self) -> LastGood:
        try:
            raw = self.path.read_bytes()
            self.revision, self.raw = feed.parse_value(raw).revision, raw
        except FileNotFoundError:
            pass
        except (OSError, feed.FeedValueError) as exc:  # unreadable: the feed will tell again
            log.error("last_good_unreadable", path=str(self.path), error=str(exc))
        return self

    def save(self, revision: int, doc: PolicyDoc) -> None:
        """Atomically (write, fsync, rename): a crash leaves the old file or the new one."""
        raw = feed.encode(revision, to_data(doc))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".last-good-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("last_good_not_saved", path=str(self.path), error=str(exc))
            Path(tmp).unlink(missing_ok=True)
            return
        self.revision, self.raw = revision, raw
