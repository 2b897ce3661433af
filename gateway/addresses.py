"""host:port strings from settings and flags, parsed once, with errors that name the setting.

GATEWAY_LISTEN and GATEWAY_AUTHZ_HTTP_LISTEN (and `envoy-config --sidecar/--authz-http`)
also take `unix:/abs/path.sock`, a Unix domain socket, for the benchmarks' `--uds`: measured
against loopback TCP it saved nothing (docs/benchmarks.md, "2026-12-06: Envoy to the sidecar
over Unix sockets"), so it is not a documented option. uvloop and gRPC bind over a stale socket
file themselves; gRPC removes its socket when it stops, the sidecar the door's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import stat

UNIX = "unix:"
# sockaddr_un's sun_path is 108 bytes with its terminating NUL (Linux)
MAX_UNIX_PATH = 107


class AddressError(ValueError):
    """A setting or flag that is not host:port (the command line prints it, exit 2)."""


def split_hostport(hostport: str, what: str = "address") -> tuple[str, int]:
    """'127.0.0.1:9001' or '[::1]:9001' -> (host, port); AddressError naming `what` otherwise."""
    host, sep, port_text = hostport.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise AddressError(f"{what}: {hostport!r} is not host:port")
    return host, int(port_text)


def unix_path(address: str, what: str = "address") -> str | None:
    """'unix:/run/gw/door.sock' -> '/run/gw/door.sock'; None for any other address;
    AddressError naming `what` for a path that is not absolute or too long for a socket."""
    if not address.startswith(UNIX):
        return None
    path = address.removeprefix(UNIX)
    if not path.startswith("/") or path.startswith("//"):
        raise AddressError(f"{what}: {address!r} is not unix:/absolute/path")
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        raise AddressError(f"{what}: {address!r}: a socket path is at most "
                           f"{MAX_UNIX_PATH} bytes")
    return path


def check_listen(address: str, what: str) -> None:
    """A listen address the sidecar can serve Envoy on: host:port or unix:/path."""
    if unix_path(address, what) is None:
        split_hostport(address, what)


def remove_socket(address: str) -> None:
    """On shutdown: the socket file of a unix: listen address, if it is still there."""
    path = address.removeprefix(UNIX) if address.startswith(UNIX) else None
    if path:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
