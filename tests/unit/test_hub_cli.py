"""The hub commands' flags (DESIGN §10: "settings from env as in §7; `--bootstrap`
overrides"), without Kafka: what each long-running command would follow."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.settings import Settings


def test_policy_sync_takes_the_hubs_kafka_from_bootstrap_over_the_env(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def run_sync(settings: Settings, syncer_id: str,
                       extra: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
                       allowances: Any = None) -> None:
        follower = getattr(extra[0], "__self__", None)
        assert allowances is getattr(follower, "state", None)  # its state: `policy status`
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


@pytest.mark.parametrize("spoke", ["", " ", "eu-1/vm-4", "/"])
def test_hub_publish_refuses_a_spoke_id_no_spoke_can_have(
        spoke: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GATEWAY_SPOKE is never blank nor holds a '/' (the status key is SPOKE/INSTANCE): an
    entry for such a key is followed by no spoke, yet took a revision and showed in `hub
    status`. Refused before Kafka is asked (none answers here): exit 2, nothing published."""
    doc = tmp_path / "p.yaml"
    doc.write_text("models: {m: {}}\n")
    assert main(["hub", "publish", str(doc), "--spoke", spoke,
                 "--bootstrap", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "nothing published: --spoke" in err and repr(spoke) in err
