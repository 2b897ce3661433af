"""Every Redis client of the gateway, built from the one URL (GATEWAY_REDIS_URL).

Two clients read it: the limiter's lean RespClient (gateway/limits/resp.py: the hot path)
and redis-py for policy sync and the CLI. Both read the URL with redis-py's parser
(`gateway.limits.resp.parse`) and get the same timeout policy, derived from
the admission deadline (GATEWAY_REDIS_DEADLINE_MS): a stalled Redis fails a command, it
never hangs one. A `redis+sentinel://` URL (gateway/sentinel_url.py) gives each the
primary the Sentinels name, followed across failovers: RespClient by itself, redis-py
through its Sentinel connection pool (which also drops a connection answering READONLY).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.sentinel
from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

from gateway.limits.resp import RespClient, parse
from gateway.sentinel_url import SentinelURL, is_sentinel, parse_sentinel


def timeouts(deadline: float) -> tuple[float, float]:
    """(per command, connect): wider than the deadline, which is the limiter's own bound."""
    return max(deadline * 4, 1.0), max(deadline * 2, 0.5)


def limiter_client(url: str, deadline: float) -> RespClient:
    timeout, connect = timeouts(deadline)
    return RespClient(url, timeout=timeout, connect_timeout=connect)


def policy_client(url: str, deadline: float) -> Redis:
    timeout, connect = timeouts(deadline)
    kw: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": connect,
                          "health_check_interval": 0}
    if not is_sentinel(url):
        return Redis.from_url(url, **kw)
    target = parse_sentinel(url)
    node = _node_kwargs(target)
    sentinels = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(node, kw))
    return sentinels.master_for(target.service, redis_class=Redis, **node, **kw)


def sync_client(url: str, **kw: Any) -> redis.Redis:
    """A blocking redis-py client for any gateway URL (tests, tools): the primary, under
    Sentinel."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kw)
    target = parse_sentinel(url)
    node = _node_kwargs(target)
    sentinels = redis.sentinel.Sentinel(list(target.sentinels),
                                        sentinel_kwargs=_sentinel_kwargs(node, kw))
    return sentinels.master_for(target.service, **node, **kw)


def _node_kwargs(target: SentinelURL) -> dict[str, Any]:
    """The data nodes' connection options (credentials, DB, TLS) as redis-py's Sentinel pool
    takes them: `ssl=True` instead of a connection class."""
    opts = parse(target.node("127.0.0.1", 6379))
    for k in ("host", "port"):
        opts.pop(k, None)
    if opts.pop("connection_class", None) is not None or target.tls:
        opts["ssl"] = True
    return opts


def _sentinel_kwargs(node: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """Sentinels: the nodes' TLS and timeouts, never their password or DB."""
    tls = {k: v for k, v in node.items() if k == "ssl" or k.startswith("ssl_")}
    return {**tls, **{k: v for k, v in kw.items() if k.startswith("socket_")}}
