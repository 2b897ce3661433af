"""The HTTP/1.1 request head, as the sidecar's plain-HTTP listeners read it (the Check's door,
gateway/server/authz_http.py, and the records' listener, records_http.py): Envoy's HTTP
client is all that talks to them, so a head that is not plainly HTTP/1.x is refused."""

from __future__ import annotations

MAX_HEAD = 64 * 1024  # a larger head is refused before it is parsed


class BadRequest(ValueError):
    pass


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, target, headers with lower-case names) of a request head (without its blank
    line). Repeated headers are joined with "," as in a CheckRequest."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise BadRequest("not an HTTP/1.x request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header line")
        k, v = name.decode("latin-1").lower(), value.strip().decode("latin-1")
        headers[k] = f"{headers[k]},{v}" if k in headers else v
    return parts[0].decode("latin-1"), parts[1].decode("latin-1"), headers
