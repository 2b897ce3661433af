"""Every Redis client of the gateway, built from the one URL (GATEWAY_REDIS_URL).

Two clients read it: the limiter's lean RespClient (gateway/limits/resp.py: the hot path)
and redis-py for policy sync and the CLI. Both read the URL with redis-py's parser
(`gateway.limits.resp.parse`) and get the same timeout policy, derived from
the admission deadline (GATEWAY_REDIS_DEADLINE_MS): a stalled Redis fails a command, it
never hangs one.
"""

from __future__ import annotations

from redis.asyncio import Redis

from gateway.limits.resp import RespClient


def timeouts(deadline: float) -> tuple[float, float]:
    """(per command, connect): wider than the deadline, which is the limiter's own bound."""
    return max(deadline * 4, 1.0), max(deadline * 2, 0.5)


def limiter_client(url: str, deadline: float) -> RespClient:
    timeout, connect = timeouts(deadline)
    return RespClient(url, timeout=timeout, connect_timeout=connect)


def policy_client(url: str, deadline: float) -> Redis:
    timeout, connect = timeouts(deadline)
    return Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=connect,
                          health_check_interval=0)
