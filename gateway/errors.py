"""The gateway's exceptions, modelled once at each boundary.

    GatewayError
     ├── PolicyError        an invalid policy document; carries the path of each problem
     ├── StoreUnavailable   the limiter/policy store (Redis) is down or slower than the deadline
     │    └── StoreTimeout  ... slower: the store may still commit what it was asked
     ├── BodyError          a request body that is not the JSON the endpoint expects
     └── PathError          a request path no engine should see (not absolute, bad encoding)

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


class StoreTimeout(StoreUnavailable):
    pass


class BodyError(GatewayError):
    pass


class PathError(GatewayError):
    pass
