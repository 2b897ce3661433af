"""A whole spoke for tests: the test policy with one key per case, published and served;
openai clients; the usage events read back from the topic."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson

from devspoke.procs import free_port
from devspoke.publish import publish as publish_policy
from devspoke.stack import Spoke
from devspoke.usage_topic import read_topic
from gateway.policy import secrets

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
    # issue 21: both header families on a denial; impossible reservations; the retry rule
    "rps1tpm": {"limits": {"rps": 1, "burst": 1, "tokens_per_minute": 100000}},
    "rpstpm": {"limits": {"rps": 50, "tokens_per_minute": 400}},
    "tpm1234": {"limits": {"tokens_per_minute": 1234}},
    "slide": {"limits": {"tokens_per_minute": 1000}},
    "wide": {"team": "metered"},  # for tight-model, whose model tier has the limits
    "teamtpm": {"team": "teamtpm"},  # its team has rps 1 and a token limit
    # a 429 carries both families when any tier has them: a tokens_per_day-only key whose
    # team has an rps
    "tpdteamrps": {"team": "rpsonly", "limits": {"tokens_per_day": 400}},
    # the 429 names the limit that binds the wait; count_tokens past a spent token window
    "slowtpd": {"limits": {"rps": 0.05, "burst": 1, "tokens_per_day": 400}},
    "counttpd": {"limits": {"rps": 20, "burst": 20, "tokens_per_day": 400}},
    # an image is a fixed figure of tokens, not its base64 as text
    "vision": {"limits": {"tokens_per_minute": 50000}},
}


def policy_doc(keys: dict[str, str]) -> dict[str, Any]:
    """keys: key id → secret."""
    doc: dict[str, Any] = {
        "models": {"mock-model": {}, "mock-other": {}, "other-model": {},
                   "tight-model": {"limits": {"rps": 1, "burst": 1,
                                              "tokens_per_minute": 1_000_000}}},
        "teams": {
            "t1": {"models": ["mock-*"]},
            "tiny": {"models": ["*"], "limits": {"rps": 1, "burst": 1}},
            "metered": {"models": ["*"]},
            "teamtpm": {"models": ["mock-*"], "limits": {"rps": 1, "burst": 1,
                                                         "tokens_per_minute": 200000}},
            "rpsonly": {"models": ["mock-*"], "limits": {"rps": 2, "burst": 2}},
        },
        "keys": {},
        "passthrough": [{"path": "/tokenize", "methods": ["POST"]},
                        {"path": "/v1/models", "methods": ["HEAD"]}],  # an allowed HEAD
    }
    for key_id, extra in KEY_LIMITS.items():
        entry = {"team": "t1", "sha256": secrets.digest(keys[key_id]).hex()}
        entry.update(extra)
        doc["keys"][key_id] = entry
    return doc


def publish(redis_url: str, doc: dict[str, Any]) -> int:
    """The whole test policy as the next revision (keys it no longer names are dropped)."""
    return publish_policy(redis_url, doc, "t", prune=True)


def start_spoke(workdir: Path, **kw: Any) -> tuple[Spoke, dict[str, str]]:
    """A started Spoke (its keyword arguments) serving the test policy; its secrets by key id."""
    kw.setdefault("sidecar_env", {}).setdefault("GATEWAY_CONTINUOUS_USAGE_MODELS", "mock-other")
    spoke = Spoke(workdir=workdir, listen_port=free_port(), **kw).start()
    keys = {k: secrets.new_secret(k) for k in KEY_LIMITS}
    try:
        publish(spoke.redis_url, policy_doc(keys))
        spoke.wait_ready()  # 30 s: a busy machine (a parallel `make test`) starts it slower
    except BaseException:
        spoke.stop()  # a fixture that fails in set-up gets no teardown: no orphaned Envoy
        raise
    return spoke, keys


def client(spoke: Spoke, key: str | None, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=spoke.base_url, api_key=key or "", max_retries=0, **kw)


def chat(c: openai.OpenAI, model: str = "mock-model", **kw: Any) -> Any:
    return c.chat.completions.create(
        model=model, messages=kw.pop("messages", [{"role": "user", "content": "hello there"}]),
        max_tokens=kw.pop("max_tokens", 4), **kw)


def read_events(bootstrap: str, want: set[str] | None = None, timeout: float = 15.0,
                settle: float = 0.5) -> list[dict[str, Any]]:
    """All events on the topic (those in `want`, if given), read from the beginning.

    Returns once every wanted id has been seen and `settle` more seconds brought nothing
    new (so a duplicate would show), or at `timeout`.
    """
    out: list[dict[str, Any]] = []
    seen: set[str] = set()

    def keep(m: Any) -> bool:
        if not m.value:
            return False
        event = orjson.loads(m.value)
        if want is not None and event["event_id"] not in want:
            return False
        out.append(event)
        seen.add(event["event_id"])
        return True

    done = None if want is None else (lambda: want <= seen)
    asyncio.run(read_topic(bootstrap, keep, done, timeout=timeout, settle=settle))
    return out


def anthropic_client(spoke: Spoke, key: str | None, bearer: bool = False,
                     **kw: Any) -> anthropic.Anthropic:
    """The official anthropic SDK through the spoke's Envoy: the key as `x-api-key`, or as
    `Authorization: Bearer` with `bearer`. (anthropic 2.x sends `api_key=` as a Bearer token
    too, so the x-api-key client sets that header itself and omits Authorization.)"""
    if bearer:
        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{spoke.listen_port}",
                                   max_retries=0, auth_token=key, **kw)
    headers = {**kw.pop("default_headers", {}), "x-api-key": key or "",
               "Authorization": anthropic.Omit()}
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{spoke.listen_port}", max_retries=0,
                               api_key=key or "", default_headers=headers, **kw)
