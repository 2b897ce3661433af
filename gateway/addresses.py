"""host:port strings from settings and flags, parsed once, with errors that name the setting."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator

from gateway.errors import ListenError


class AddressError(ValueError):
    """A setting or flag that is not host:port (the command line prints it, exit 2)."""


def split_hostport(hostport: str, what: str = "address") -> tuple[str, int]:
    """'127.0.0.1:9001' or '[::1]:9001' -> (host, port); AddressError naming `what` otherwise."""
    host, sep, port_text = hostport.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise AddressError(f"{what}: {hostport!r} is not host:port")
    return host, int(port_text)


@contextlib.contextmanager
def binding(address: str, setting: str) -> Iterator[tuple[str, int]]:
    """The address's (host, port), to bind inside: a failure is one ListenError naming the
    address and its setting, not a traceback ('cannot listen on 127.0.0.1:9102
    (GATEWAY_METRICS_LISTEN): Address already in use'). gRPC says only
    RuntimeError('Failed to bind ...'); asyncio an OSError."""
    hostport = split_hostport(address, setting)  # an AddressError goes on as it is
    try:
        yield hostport
    except OSError as exc:
        # a resolver's error (socket.gaierror) has a negative errno, and its own strerror
        reason = exc.strerror or (os.strerror(exc.errno) if exc.errno is not None
                                  else str(exc))
        raise ListenError(f"cannot listen on {address} ({setting}): {reason}") from None
    except RuntimeError as exc:
        raise ListenError(f"cannot listen on {address} ({setting}): {exc}") from None


def can_bind(host: str, port: int) -> None:
    """Raise the OSError a bind to host:port would meet (inside `binding`: one line with its
    reason), with the options gRPC's own bind uses (SO_REUSEADDR, SO_REUSEPORT), so it is
    refused exactly where gRPC's would be: gRPC says only 'Failed to bind ...; set
    GRPC_VERBOSITY=debug', after a line of its C++ log. Another process holding the port
    with SO_REUSEPORT (a second sidecar, GATEWAY_WORKERS) is no failure, as for gRPC. A host
    that does not resolve raises the resolver's error (socket.gaierror)."""
    addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    refused: OSError | None = None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                refused = exc
                continue
            return  # gRPC binds if any of the host's addresses does
    if refused is not None:
        raise refused


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
