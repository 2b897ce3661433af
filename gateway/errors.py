"""Every exception the gateway raises, in one tree (a second base, in brackets, keeps the
stdlib's meaning for callers that catch that).

    GatewayError
     ├── PolicyError        an invalid policy document; carries the path of each problem
     ├── StoreUnavailable   the limiter/policy store (Redis) is down or slower than the deadline
     │    └── StoreInDoubt  ... after it was asked: it may have committed, or still commit, it
     ├── BodyError          a request body that is not the JSON the endpoint expects
     ├── PathError          a request path no engine should see (not absolute, bad encoding)
     ├── RedisGone          [ConnectionError] the limiter's connection failed or timed out
     │    └── RedisLost     ... with this command written: Redis may have run it
     ├── RedisReplyError    Redis answered one command with an error reply
     ├── RevisionConflict   the policy revision moved while it was being edited
     ├── ApplyRefused       [ValueError] `policy apply`, `hub publish` would do harm unasked
     ├── SinkUnavailable    not delivered to Kafka/JSONL: try again later
     ├── TopicRefused       the broker would not create a topic that must be compacted
     ├── SpoolLocked        the spool directory belongs to a live instance
     ├── SpoolUnusable      the spool directory cannot be made or locked (a path, permissions)
     └── ReportError        [ValueError] a usage report that cannot be answered

The limiter turns RedisLost into StoreInDoubt, and RedisGone/RedisReplyError into
StoreUnavailable, at its edge.
A denial is not an exception: it is a value (`gateway.authz.decision.Deny`).
"""

from __future__ import annotations


class GatewayError(Exception):
    pass


class PolicyError(GatewayError):
    """Every problem found in one document, each as 'path.to.field: what is wrong'."""

    def __init__(self, problems: list[str], source: str = "policy") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))


class StoreUnavailable(GatewayError):
    pass


class StoreInDoubt(StoreUnavailable):
    """No answer (past the deadline, or the connection died) for a request the store was
    sent: it may have committed it, so the caller undoes it (voids the admission)."""


class BodyError(GatewayError):
    pass


class PathError(GatewayError):
    pass


class RedisGone(GatewayError, ConnectionError):
    """The connection failed, timed out or could not be made."""


class RedisLost(RedisGone):
    """The connection failed after this command was written: Redis may have run it."""


class RedisReplyError(GatewayError):
    """Redis answered this command with an error reply."""


class RevisionConflict(GatewayError):
    pass


class ApplyRefused(GatewayError, ValueError):
    """`policy apply` or `hub publish` would do harm the operator did not ask for; nothing was
    published."""


class SinkUnavailable(GatewayError):
    pass


class TopicRefused(GatewayError):
    """The broker refused to create a topic that must be compacted (the policy feed), and
    it does not exist: nothing was written, so none is auto-created plain. An operator's act
    (create it, or change the setting named), not a retry, is what helps."""


class SpoolLocked(GatewayError):
    pass


class SpoolUnusable(GatewayError):
    pass


class ListenError(GatewayError):
    """A listen address this process cannot bind (taken, not this host's): names its setting."""


class ReportError(GatewayError, ValueError):
    """A request for a report that cannot be answered (a bad date, an empty database)."""
