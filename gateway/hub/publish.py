"""`gateway hub publish`: a validated document onto the feed as the next revision.

Validation is `policy apply`'s (the same parser: an invalid file publishes nothing). The
revision is the feed's one sequence: the highest ever put on the topic + 1, read from the
topic itself, so the hub keeps no state of its own. Two publishers at the same instant could
take the same number; run one hub publisher at a time (a spoke never applies a revision not
newer than the one it holds, so the later of two equal numbers is ignored, not mixed in).
"""

from __future__ import annotations

from gateway.hub import feed
from gateway.hub.topics import POLICY_TOPIC, ensure_compacted, produce, read_all
from gateway.policy.loader import parse_doc, to_data


async def publish(bootstrap: str, text: bytes, source: str, spoke: str = feed.EVERY_SPOKE,
                  *, idempotence: bool = True) -> int:
    """Validate `text` (PolicyError, naming the path: nothing published) and put it on the
    feed for `spoke` (`*`: every spoke without its own entry); its revision."""
    if not spoke:
        raise ValueError("--spoke: a spoke id, or * for every spoke")
    doc = parse_doc(text, source)
    await ensure_compacted(bootstrap, POLICY_TOPIC)
    revision = feed.max_revision(await read_all(bootstrap, POLICY_TOPIC)) + 1
    await produce(bootstrap, POLICY_TOPIC, spoke, feed.encode(revision, to_data(doc)),
                  idempotence=idempotence)
    return revision
