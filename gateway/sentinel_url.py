"""`redis+sentinel://` URLs (DESIGN §10): where a spoke's Redis is a primary with replicas
that Sentinels watch, the URL names the Sentinels and the service, never a data node, so a
failover needs no new URL and no restart.

    redis+sentinel://[[user]:password@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?query]
    rediss+sentinel://...   the same over TLS

The credentials, DB and query (TLS options) are those of a `redis://` URL and apply to the
data nodes; Sentinels get TLS when the nodes do, and no password. Pure parsing: both Redis
clients (gateway/redis_clients.py) read the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
DEFAULT_SENTINEL_PORT = 26379


def check_redis_url(url: str) -> str:
    """The URL unchanged if either client can use it, else ValueError saying why: read at
    start, before anything connects."""
    if is_sentinel(url):
        parse_sentinel(url)
    else:
        from redis.connection import parse_url

        try:
            parse_url(url)
        except ValueError as exc:
            raise ValueError(f"{exc}; or redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
                             f" (rediss+sentinel:// for TLS)") from None
        _check_plain(url)
    return url


def _check_plain(url: str) -> None:
    """What redis-py reads without a word but not as written: a `redis[s]://` URL with no
    host (localhost:6379) or a database path that is not one number ('/notadb' is database
    0, '/0/1' database 1). The URL, which may hold a password, is not repeated."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("redis", "rediss"):
        return  # unix://: a socket path, its database in ?db=
    if not parts.hostname:
        raise ValueError(f"{parts.scheme}:// URL names no host ({parts.scheme}://HOST[:PORT]"
                         f"[/DB])")
    if not re.fullmatch(r"/?[0-9]*", parts.path):
        raise ValueError("the database, the URL's path, must be one number (/0 to /15 on a "
                         "default Redis)")


def is_sentinel(url: str) -> bool:
    return url.partition("://")[0].lower() in SCHEMES


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    tls: bool
    # a `redis[s]://` URL carrying the credentials, DB and query of every data node; its
    # host is a placeholder, replaced by the primary the Sentinels name (`node`)
    node_template: str

    def node(self, host: str, port: int) -> str:
        """The `redis[s]://` URL of one data node (what a plain client connects to)."""
        return self.node_template.replace("@{node}", f"@{_hostport(host, port)}", 1)


def parse_sentinel(url: str) -> SentinelURL:
    """ValueError, naming the part, for anything but the form above."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): "
                         f"{_redact(url)}")
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise ValueError(f"Sentinel URL names no Sentinel (HOST:PORT[,HOST:PORT...]): "
                         f"{_redact(url)}")
    sentinels = tuple(_sentinel(h, url) for h in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if path and path[-1] == "":
        path.pop()
    if not path or not path[0]:
        raise ValueError(f"Sentinel URL names no service (…/SERVICE[/DB]): {_redact(url)}")
    if len(path) > 2:
        raise ValueError(f"Sentinel URL path must be /SERVICE[/DB]: {_redact(url)}")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise ValueError(f"Sentinel URL DB must be a number, got {path[1]!r}: "
                             f"{_redact(url)}")
        db = int(path[1])
    node_scheme = SCHEMES[scheme.lower()]
    query = f"?{parts.query}" if parts.query else ""
    # always an "@": the placeholder is found by it even in a URL with no credentials
    template = f"{node_scheme}://{userinfo}@{{node}}/{db}{query}"
    return SentinelURL(sentinels, path[0], db, node_scheme == "rediss", template)


def _sentinel(hostport: str, url: str) -> tuple[str, int]:
    host, colon, port = hostport.strip().rpartition(":")
    if not colon:
        host, port = port, str(DEFAULT_SENTINEL_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad Sentinel address {hostport!r} (HOST:PORT): {_redact(url)}")
    return host, int(port)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{quote(host)}:{port}"


def _redact(url: str) -> str:
    """The URL without its password: errors end up in logs."""
    head, at, tail = url.rpartition("@")
    if not at:
        return url
    scheme, sep, userinfo = head.partition("://")
    user = userinfo.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{tail}"
