"""redis+sentinel:// URLs (DESIGN §10): what each part means, and a clear error for each
wrong one (with the password never echoed)."""

from __future__ import annotations

import pytest

from gateway.limits.resp import demoted, is_primary, parse
from gateway.redis_clients import _node_kwargs
from gateway.sentinel_url import is_sentinel, parse_sentinel


def test_sentinels_service_db_and_credentials() -> None:
    u = parse_sentinel("redis+sentinel://user:pw@10.0.0.1:26379,s2:26380,[::1]:5/spoke-a/3")
    assert u.sentinels == (("10.0.0.1", 26379), ("s2", 26380), ("::1", 5))
    assert (u.service, u.db, u.tls) == ("spoke-a", 3, False)
    node = parse(u.node("10.1.1.1", 6380))  # the data node's options, as redis:// gives them
    assert (node["host"], node["port"], node["db"]) == ("10.1.1.1", 6380, 3)
    assert (node["username"], node["password"]) == ("user", "pw")


def test_defaults_db_zero_and_port_26379() -> None:
    u = parse_sentinel("redis+sentinel://sentinel/svc")
    assert (u.sentinels, u.service, u.db) == ((("sentinel", 26379),), "svc", 0)
    assert "password" not in parse(u.node("h", 1))


def test_tls_and_its_query_reach_the_nodes() -> None:
    u = parse_sentinel("rediss+sentinel://h:1/svc/0?ssl_cert_reqs=none")
    assert u.tls
    kw = _node_kwargs(u)
    assert kw["ssl"] is True and kw["ssl_cert_reqs"] == "none" and "connection_class" not in kw


def test_only_sentinel_schemes_are_sentinel() -> None:
    assert is_sentinel("redis+sentinel://h/s") and is_sentinel("REDISS+SENTINEL://h/s")
    assert not is_sentinel("redis://h:1/0") and not is_sentinel("unix:///tmp/s")


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h:1", "names no service"),
    ("redis+sentinel://h:1/", "names no service"),
    ("redis+sentinel:///svc", "names no Sentinel"),
    ("redis+sentinel://h:port/svc", "bad Sentinel address 'h:port'"),
    ("redis+sentinel://h:1,:2/svc", "bad Sentinel address"),
    ("redis+sentinel://h:99999/svc", "bad Sentinel address"),
    ("redis+sentinel://h:1/svc/zero", "DB must be a number"),
    ("redis+sentinel://u:secret@h:1/svc/0/1", "/SERVICE[/DB]"),
    ("redis://h:1/0", "not a Sentinel URL"),
])
def test_bad_urls_are_refused_by_name(url: str, says: str) -> None:
    with pytest.raises(ValueError, match="Sentinel") as err:
        parse_sentinel(url)
    assert says in str(err.value)
    assert "secret" not in str(err.value)


def test_role_and_readonly_replies() -> None:
    assert is_primary([b"master", 0, []])
    assert not is_primary([b"slave", b"127.0.0.1", 6379, b"connected", 10])
    assert not is_primary(b"master") and not is_primary([])
    assert demoted("READONLY You can't write against a read only replica.")
    assert not demoted("ERR unknown command")
