"""host:port strings from settings and flags, parsed once, with errors that name the setting."""

from __future__ import annotations

import ipaddress


class AddressError(ValueError):
    """A setting or flag that is not host:port (the command line prints it, exit 2)."""


def split_hostport(hostport: str, what: str = "address") -> tuple[str, int]:
    """'127.0.0.1:9001' or '[::1]:9001' -> (host, port); AddressError naming `what` otherwise."""
    host, sep, port_text = hostport.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise AddressError(f"{what}: {hostport!r} is not host:port")
    return host, int(port_text)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
