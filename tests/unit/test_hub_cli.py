"""The hub commands' flags (DESIGN §10: "settings from env as in §7; `--bootstrap`
overrides"), without Kafka: what each long-running command would follow."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import pytest

from gateway.cli import main
from gateway.settings import Settings


def test_policy_sync_takes_the_hubs_kafka_from_bootstrap_over_the_env(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def run_sync(settings: Settings, syncer_id: str,
                       extra: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()) -> None:
        follower = getattr(extra[0], "__self__", None)
        seen.update(feed=settings.feed_bootstrap, id=syncer_id,
                    allowances=getattr(follower, "bootstrap", None))

    monkeypatch.setattr("gateway.hub.sync.run_sync", run_sync)
    monkeypatch.setenv("GATEWAY_REDIS_URL", "redis://127.0.0.1:1")
    monkeypatch.setenv("GATEWAY_KAFKA_BOOTSTRAP", "usage-kafka:9092")
    monkeypatch.setenv("GATEWAY_HUB_BOOTSTRAP", "hub-env:9092")
    assert main(["policy", "sync", "--id", "s1", "--bootstrap", "hub-flag:9092"]) == 0
    assert seen == {"feed": "hub-flag:9092", "id": "s1", "allowances": "hub-flag:9092"}

    seen.clear()  # without the flag: GATEWAY_HUB_BOOTSTRAP, as before
    assert main(["policy", "sync", "--id", "s1"]) == 0
    assert seen["feed"] == seen["allowances"] == "hub-env:9092"
