"""`gateway keys rotate` through the command line on a real Redis: a new revision the
sidecars follow, in which both secrets are the same key until the grace ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
import yaml
from redis.asyncio import Redis

from gateway.cli import main
from gateway.policy import secrets
from gateway.policy.model import Policy
from gateway.policy.store import PolicyStore

POLICY = {"models": {"m": {}}, "teams": {"t": {"models": ["*"]}}}


def _fields(out: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in out.splitlines())}


def _held(redis_url: str) -> tuple[int, Policy]:
    """The revision in Redis, compiled as a sidecar compiles what it follows."""
    async def read() -> tuple[int, Policy]:
        client = Redis.from_url(redis_url)
        try:
            loaded = await PolicyStore(client).load_doc()
        finally:
            await client.aclose()
        assert loaded is not None
        return loaded[0], Policy.compile(loaded[1], loaded[0])
    return asyncio.run(read())


def test_rotate_through_the_cli_on_redis(redis_url: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--redis-url", redis_url]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(POLICY))
    assert main(["policy", "apply", str(tmp_path / "p.yaml"), "--allow-empty", *flags]) == 0
    capsys.readouterr()
    assert main(["keys", "create", "--team", "t", "--key-id", "rot", "--tokens-per-day",
                 "1000", *flags]) == 0
    old = _fields(capsys.readouterr().out)["secret"]

    assert main(["keys", "rotate", "rot", "--grace", "1h", *flags]) == 0
    out = capsys.readouterr()
    got = _fields(out.out)
    new = got["secret"]
    assert got["key_id"] == "rot" and got["revision"] == "3"
    assert new != old and new.startswith("sk-gw-rot-") and len(secrets.random_part(new)) == 43
    assert got["previous"].startswith("valid until ")
    until = got["previous"].removeprefix("valid until ")

    rev, policy = _held(redis_url)
    assert rev == 3
    by_new = policy.keys_by_digest[secrets.digest(new)]
    by_old = policy.keys_by_digest[secrets.digest(old)]
    assert by_new.key_id == by_old.key_id == "rot"
    assert by_old.limits == by_new.limits and by_new.limits.tokens_per_day == 1000
    assert by_new.expires_at is None and by_old.expires_at is not None

    assert main(["keys", "list", "-o", "json", *flags]) == 0
    [row] = orjson.loads(capsys.readouterr().out)
    assert row["old_secret_until"] == until and row["state"] == "active"
    assert main(["keys", "show", "rot", "-o", "json", *flags]) == 0
    shown = capsys.readouterr().out
    assert orjson.loads(shown)["old_secrets_until"] == [until]
    for secret in (old, new):  # never a secret nor its digest
        assert secrets.digest(secret).hex() not in shown + row.__repr__()

    assert main(["keys", "rotate", "rot", "--grace", "0s", *flags]) == 0
    newest = _fields(capsys.readouterr().out)
    assert newest["previous"] == "ended now" and newest["revision"] == "4"
    _, policy = _held(redis_url)
    assert set(policy.keys_by_digest) == {secrets.digest(newest["secret"])}

    assert main(["keys", "rotate", "nope", *flags]) == 2
    assert "no key nope" in capsys.readouterr().err
    assert _held(redis_url)[0] == 4  # nothing published
