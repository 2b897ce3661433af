"""Helpers for tests that run a whole spoke: a policy with a key per case, publishing it,
reading usage events back from the topic, openai clients."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import yaml
from redis.asyncio import Redis

from gateway.dev.procs import free_port
from gateway.dev.stack import Spoke
from gateway.policy import secrets
from gateway.policy.admin import RedisBackend, apply
from gateway.policy.store import PolicyStore

KEY_LIMITS: dict[str, dict[str, Any]] = {
    "good": {},
    "narrow": {"models": ["mock-model"]},
    "expired": {"expires_at": "2020-01-01T00:00:00Z"},
    "disabled": {"disabled": True},
    "rps1": {"limits": {"rps": 1, "burst": 1}},
    "conc4": {"limits": {"concurrency": 4}},
    "tpm": {"limits": {"tokens_per_minute": 400}},
    "tpd": {"limits": {"tokens_per_day": 400}},
    "revokeme": {},
    "teamrps": {"team": "tiny"},
    "fault": {"limits": {"concurrency": 64, "tokens_per_day": 10**9}},
    "bench": {"limits": {"rps": 100000, "concurrency": 10000, "tokens_per_day": 10**12}},
}


def policy_doc(keys: dict[str, str]) -> dict[str, Any]:
    """keys: key id → secret."""
    doc: dict[str, Any] = {
        "models": {"mock-model": {}, "mock-other": {}, "other-model": {}},
        "teams": {
            "t1": {"models": ["mock-*"]},
            "tiny": {"models": ["*"], "limits": {"rps": 1, "burst": 1}},
        },
        "keys": {},
        "passthrough": [{"path": "/tokenize", "methods": ["POST"]}],
    }
    for key_id, extra in KEY_LIMITS.items():
        entry = {"team": "t1", "sha256": secrets.digest(keys[key_id]).hex()}
        entry.update(extra)
        doc["keys"][key_id] = entry
    return doc


def publish(redis_url: str, doc: dict[str, Any]) -> int:
    async def go() -> int:
        client = Redis.from_url(redis_url)
        try:
            done = await apply(RedisBackend(PolicyStore(client)), yaml.safe_dump(doc).encode(),
                               "t", prune=True)
            assert done.revision is not None
            return done.revision
        finally:
            await client.aclose()

    return asyncio.run(go())


def wait_ready(spoke: Spoke, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{spoke.metrics_url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError("sidecar never became ready")


def start_spoke(workdir: Path, **kw: Any) -> tuple[Spoke, dict[str, str]]:
    kw.setdefault("sidecar_env", {}).setdefault("GATEWAY_CONTINUOUS_USAGE_MODELS", "mock-other")
    spoke = Spoke(workdir=workdir, listen_port=free_port(), **kw).start()
    keys = {k: secrets.new_secret(k) for k in KEY_LIMITS}
    publish(spoke.redis_url, policy_doc(keys))
    wait_ready(spoke)
    return spoke, keys


def client(spoke: Spoke, key: str | None, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=spoke.base_url, api_key=key or "", max_retries=0, **kw)


def chat(c: openai.OpenAI, model: str = "mock-model", **kw: Any) -> Any:
    return c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}],
        max_tokens=kw.pop("max_tokens", 4), **kw)


def read_events(bootstrap: str, want: set[str] | None = None, timeout: float = 15.0,
                settle: float = 0.5) -> list[dict[str, Any]]:
    """All events on the topic (those in `want`, if given), read from the beginning.

    Returns once every wanted id has been seen and `settle` more seconds brought nothing
    new (so a duplicate would show), or at `timeout`.
    """
    import orjson
    from aiokafka import AIOKafkaConsumer

    async def go() -> list[dict[str, Any]]:
        c = AIOKafkaConsumer("llm.usage.v1", bootstrap_servers=bootstrap, group_id=None,
                             auto_offset_reset="earliest", enable_auto_commit=False)
        await c.start()
        out: list[dict[str, Any]] = []
        quiet_since = None
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                batch = await c.getmany(timeout_ms=200)
                got = [orjson.loads(m.value) for ms in batch.values() for m in ms if m.value]
                got = [e for e in got if want is None or e["event_id"] in want]
                out += got
                seen = {e["event_id"] for e in out}
                if want is not None and want <= seen:
                    if got or quiet_since is None:
                        quiet_since = time.monotonic()
                    elif time.monotonic() - quiet_since >= settle:
                        break
        finally:
            await c.stop()
        return out

    return asyncio.run(go())


def anthropic_client(spoke: Spoke, key: str | None, bearer: bool = False,
                     **kw: Any) -> anthropic.Anthropic:
    """The official anthropic SDK through the spoke's Envoy: the key as `x-api-key` (the
    SDK's default), or as `Authorization: Bearer` with `bearer`."""
    auth = {"auth_token": key} if bearer else {"api_key": key or ""}
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{spoke.listen_port}", max_retries=0,
                               **auth, **kw)
