"""`gateway policy apply` and `keys create` through the command line on a real Redis, where
what Redis holds is not what the command line itself wrote."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
import yaml
from redis.asyncio import Redis

from gateway.cli import main
from gateway.policy.store import PolicyStore

POLICY = {"models": {"m": {}}, "teams": {"t": {"models": ["*"]}},
          "keys": {"k1": {"team": "t", "sha256": "ab" * 32}}}


def _store(redis_url: str, coro_of: object) -> object:
    async def run() -> object:
        client = Redis.from_url(redis_url)
        try:
            return await coro_of(PolicyStore(client))  # type: ignore[operator]
        finally:
            await client.aclose()
    return asyncio.run(run())


def test_apply_replaces_a_revision_the_instances_nacked(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A revision no instance can load (a buggy hub, a hand edit: DESIGN §2's NACK) is
    healed by applying a good one, the next revision. `policy apply` read the stored
    revision first, failed on it and printed its errors as the file's ("invalid policy,
    nothing published", exit 2): the only way out was redis-cli."""
    flags = ["--redis-url", redis_url]
    good = tmp_path / "p.yaml"
    good.write_text(yaml.safe_dump(POLICY))
    assert main(["policy", "apply", str(good), *flags]) == 0
    bad = orjson.dumps({"models": {"m": {"limits": {"rpz": 1}}}})
    _store(redis_url, lambda s: s.publish_raw(2, bad))
    capsys.readouterr()

    assert main(["policy", "apply", str(good), *flags]) == 0
    out = capsys.readouterr()
    assert "applied revision 3" in out.out
    assert "warning: revision 2 in Redis is invalid" in out.err
    assert "models.m.limits.rpz" in out.err
    loaded = _store(redis_url, lambda s: s.load_doc())
    assert loaded is not None and loaded[0] == 3  # type: ignore[index]
    assert set(loaded[1].keys) == {"k1"}  # type: ignore[index]
