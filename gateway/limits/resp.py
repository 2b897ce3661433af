"""A lean, pipelined Redis client for the limiter's hot path (admit, settle, renew).

redis-py's asyncio client costs ~150-250 µs of CPU per command (pool, retry wrapper,
per-command bookkeeping); the limiter sends one or two scripts per request, which made
Redis a third of the sidecar's CPU. This client keeps one connection, writes each command
the moment it is called (so concurrent callers pipeline), matches replies to callers in
order and parses them with hiredis.

Failure model: any connection error, protocol error or reply slower than `timeout` closes
the connection and fails every caller waiting on it with `RedisLost` (its command was
written, so Redis may have run it); a call that could not be written fails with
`RedisGone`; the next call reconnects. An error reply (`-ERR ...`) fails only its own
caller, with `RedisReplyError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from gateway.errors import RedisGone, RedisLost, RedisReplyError
from gateway.sentinel_url import SentinelURL, is_sentinel, parse_sentinel


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop = loop
        self.timeout = timeout
        self.reader = hiredis.Reader()
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            raise RedisGone(f"connection lost: {self.lost}")
        fut = self.loop.create_future()
        self.waiting.append((fut, self.loop.time() + self.timeout))
        self.transport.write(packed)
        if self._watchdog is None:
            self._watchdog = self.loop.call_at(self.waiting[0][1], self._check_overdue)
        return fut

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RedisLost(f"protocol error: {exc}"))
                return
            if reply is False:
                return
            if not waiting:
                self._fail(RedisLost("reply without a request"))
                return
            fut, _ = waiting.popleft()
            if fut.done():  # the caller gave up; the reply still keeps the order
                continue
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(RedisReplyError(str(reply)))
                if demoted(str(reply)):  # a replica now: nothing more goes to it
                    self._fail(RedisLost(f"the server is no primary now: {reply}"))
                    return
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisLost(f"connection closed: {exc or 'by the server'}"))

    def _check_overdue(self) -> None:
        self._watchdog = None
        if not self.waiting:
            return
        deadline = self.waiting[0][1]
        if deadline <= self.loop.time():
            # every call waiting on the connection fails with it, each perhaps sent only
            # moments ago: the message names whose wait ran out
            self._fail(RedisLost(f"no reply within {self.timeout:g}s to the oldest call on "
                                 "the connection"))
        else:
            self._watchdog = self.loop.call_at(deadline, self._check_overdue)

    def _fail(self, exc: RedisLost) -> None:
        if self.lost is None:
            self.lost = exc
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.transport is not None:
            self.transport.abort()
        while self.waiting:
            fut, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)


def demoted(error: str) -> bool:
    """An error reply that means the server is a replica now (a primary demoted under us):
    it ran nothing (a replica refuses every write), and the connection must go."""
    return error.startswith("READONLY")


def is_primary(role_reply: Any) -> bool:
    """Whether a ROLE reply is a primary's (`[b"master", offset, replicas]`)."""
    return isinstance(role_reply, list) and bool(role_reply) and role_reply[0] == b"master"


def parse(url: str) -> dict[str, Any]:
    """The URL as redis-py reads it (`redis.asyncio.connection.parse_url`): one parser for
    both clients (gateway/redis_clients.py), so a URL means the same to each."""
    return dict(parse_url(url))


def tls_context(url: str) -> ssl.SSLContext | None:
    """TLS for a `rediss://` URL, from the query parameters redis-py reads too:
    `ssl_ca_certs` (a CA bundle; default: the system's), `ssl_cert_reqs` (required |
    optional | none), `ssl_check_hostname` (true | false), `ssl_certfile` and
    `ssl_keyfile` (a client certificate)."""
    return _tls(parse(url))


def _tls(opts: dict[str, Any]) -> ssl.SSLContext | None:
    if opts.get("connection_class") is not SSLConnection:
        return None
    reqs = str(opts.get("ssl_cert_reqs") or "required").lower()
    modes = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
    if reqs not in modes:
        raise ValueError(f"ssl_cert_reqs={reqs!r} in the Redis URL: expected one of "
                         f"{', '.join(modes)}")
    ctx = ssl.create_default_context(cafile=opts.get("ssl_ca_certs"))
    ctx.check_hostname = reqs == "required" and opts.get("ssl_check_hostname") is not False
    ctx.verify_mode = modes[reqs]
    if opts.get("ssl_certfile"):
        ctx.load_cert_chain(opts["ssl_certfile"], opts.get("ssl_keyfile"))
    return ctx


class RespClient:
    """`redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS; see tls_context)
    or `unix:///path/to/socket?db=N`, parsed as redis-py parses them (`parse`); or
    `redis+sentinel://` (gateway/sentinel_url.py): each connect then asks the Sentinels for
    the primary and checks its ROLE, and `follow()` drops a connection the Sentinels no
    longer name (a failover), so the next call goes to the new primary."""

    def __init__(self, url: str, timeout: float = 1.0, connect_timeout: float = 0.5) -> None:
        self.url = url
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._sentinel: SentinelURL | None = parse_sentinel(url) if is_sentinel(url) else None
        self._order = list(self._sentinel.sentinels) if self._sentinel else []  # asked in turn
        # ValueError for any other scheme, naming the ones it knows
        opts = parse(url if self._sentinel is None else self._sentinel.node("127.0.0.1", 6379))
        unix = opts.get("connection_class") is UnixDomainSocketConnection
        self._unix: str | None = opts["path"] if unix else None
        self._host = opts.get("host") or "127.0.0.1"
        self._port = int(opts.get("port") or 6379)
        self._ssl = _tls(opts)
        self._setup: list[tuple[Any, ...]] = []
        if opts.get("password") is not None:
            user, pw = opts.get("username"), opts["password"]
            self._setup.append(("AUTH", user, pw) if user else ("AUTH", pw))
        if opts.get("db"):
            self._setup.append(("SELECT", int(opts["db"])))
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self.primary: tuple[str, int] | None = None  # where the connection goes (Sentinel)

    async def call(self, *args: Any) -> Any:
        conn = self._conn
        if conn is None or conn.lost is not None:
            conn = await self._connection()
        return await conn.send(hiredis.pack_command(args))

    def live_connection(self) -> _Connection | None:
        """The connection calls go on, unless it failed (or none is open yet)."""
        conn = self._conn
        return conn if conn is not None and conn.lost is None else None

    async def follow(self) -> None:
        """Sentinel mode: if the Sentinels name another primary than the one connected to,
        drop the connection (callers waiting on it get RedisLost: in doubt). A primary cut
        off from the Sentinels keeps taking writes that a failover then discards; asking
        every second bounds that window. RedisGone if no Sentinel answers."""
        if self._sentinel is None:
            return
        named = await self._ask_sentinels(self._sentinel)
        conn = self._conn
        if conn is not None and conn.lost is None and named != self.primary:
            conn._fail(RedisLost(f"the Sentinels name another primary: {named[0]}:{named[1]}"))

    async def _connection(self) -> _Connection:
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        # shield: one caller timing out must not abort the connect the others share
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Connection:
        host, port = self._host, self._port
        if self._sentinel is not None:
            host, port = await self._ask_sentinels(self._sentinel)
        role: Any = [b"master"]
        try:
            async with asyncio.timeout(self.connect_timeout):
                conn = await self._open(host, port)
                for cmd in self._setup:
                    await conn.send(hiredis.pack_command(cmd))
                if self._sentinel is not None:
                    role = await conn.send(hiredis.pack_command(("ROLE",)))
        except (OSError, TimeoutError, RedisReplyError) as exc:
            raise RedisGone(f"cannot connect to Redis: {exc.__class__.__name__}: {exc}") from exc
        if not is_primary(role):
            conn._fail(RedisLost("not the primary"))
            raise RedisGone(f"{host}:{port}, named by the Sentinels, is no primary (ROLE "
                            f"{role[0] if isinstance(role, list) and role else role!r}): "
                            f"a failover is under way")
        self._conn, self.primary = conn, (host, port)
        return conn

    async def _open(self, host: str, port: int) -> _Connection:
        """A connection (callers bound it with connect_timeout)."""
        loop = asyncio.get_running_loop()
        if self._unix is not None:
            _, conn = await loop.create_unix_connection(
                lambda: _Connection(loop, self.timeout), self._unix)
        else:
            _, conn = await loop.create_connection(
                lambda: _Connection(loop, self.timeout), host, port, ssl=self._ssl)
        return conn

    async def _ask_sentinels(self, sentinel: SentinelURL) -> tuple[str, int]:
        """The primary's address from the first Sentinel that knows it (that one is asked
        first next time, so a dead Sentinel costs its timeout once); RedisGone if none
        does. Each Sentinel gets one short connection, bounded by connect_timeout."""
        errors = []
        ask: tuple[Any, ...] = ("SENTINEL", "get-master-addr-by-name", sentinel.service)
        for host, port in list(self._order):
            conn: _Connection | None = None
            try:
                async with asyncio.timeout(self.connect_timeout):
                    conn = await self._open(host, port)
                    reply = await conn.send(hiredis.pack_command(ask))
                if isinstance(reply, list) and len(reply) == 2:
                    self._order.remove((host, port))
                    self._order.insert(0, (host, port))
                    return reply[0].decode(), int(reply[1])
                errors.append(f"{host}:{port}: does not know {sentinel.service!r}")
            except (OSError, TimeoutError, RedisReplyError) as exc:
                errors.append(f"{host}:{port}: {exc.__class__.__name__}: {exc}")
            finally:
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
        raise RedisGone(f"no Sentinel names a primary for {sentinel.service!r}: "
                        + "; ".join(errors))

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None


class Script:
    """A Lua script called by SHA; loaded on first use and again after SCRIPT FLUSH or a
    Redis restart (NOSCRIPT)."""

    def __init__(self, client: RespClient, source: str) -> None:
        self.client = client
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, *args: Any) -> Any:
        try:
            return await self.client.call("EVALSHA", self.sha, 0, *args)
        except RedisReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.client.call("EVAL", self.source, 0, *args)
