"""The hub commands' flags (DESIGN §10: "settings from env as in §7; `--bootstrap`
overrides"), without Kafka: what each long-running command would follow."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.hub import feed
from gateway.hub.topics import POLICY_TOPIC
from gateway.policy.loader import parse_doc, to_data
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


class _Feed:
    """The hub's topics in memory, in place of Kafka: what `hub publish` put on them."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, bytes | None]]] = {}
        self.replication: dict[str, int] = {}  # the factor each topic was created with

    async def ensure_compacted(self, bootstrap: str, topic: str,
                               max_bytes: int | None = None, *, replication: int = 1,
                               required: bool = False) -> None:
        self.records.setdefault(topic, [])
        self.replication.setdefault(topic, replication)

    async def produce(self, bootstrap: str, topic: str, key: str, value: bytes | None,
                      *, idempotence: bool = True) -> None:
        self.records.setdefault(topic, []).append((key, value))

    async def read_all(self, bootstrap: str, topic: str,
                       timeout: float = 10.0) -> list[tuple[str, bytes | None]]:
        return list(self.records.get(topic, []))


@pytest.fixture
def hub_feed(monkeypatch: pytest.MonkeyPatch) -> _Feed:
    fake = _Feed()
    for name in ("ensure_compacted", "produce", "read_all"):
        monkeypatch.setattr(f"gateway.hub.publish.{name}", getattr(fake, name))
    return fake


@pytest.mark.parametrize(("text", "empty"), [
    ("{}\n", "no models and no keys"),
    ("models: {m: {}}\n", "no keys"),
    ("teams: {t: {models: ['*']}}\nkeys: {k: {team: t, sha256: '" + "0" * 64 + "'}}\n",
     "no models"),
])
def test_hub_publish_refuses_a_document_without_models_or_keys_unless_allow_empty(
        text: str, empty: str, hub_feed: _Feed, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As `policy apply`: an empty file published to `*` was a new revision, and every spoke
    without its own entry took it and refused every request. Exit 2, nothing on the feed
    (the topic not even made), unless --allow-empty."""
    doc = tmp_path / "p.yaml"
    doc.write_text(text)
    assert main(["hub", "publish", str(doc), "--bootstrap", "hub:9092"]) == 2
    err = capsys.readouterr().err
    assert f"nothing published: {doc} has {empty}:" in err and "--allow-empty" in err
    assert hub_feed.records == {}

    assert main(["hub", "publish", str(doc), "--allow-empty", "--bootstrap", "hub:9092"]) == 0
    assert capsys.readouterr().out == "published revision 1 for spoke *\n"
    entry = feed.parse_value(feed.latest(hub_feed.records[POLICY_TOPIC])["*"])
    assert entry.revision == 1 and entry.policy == to_data(parse_doc(text.encode(), "p"))


def test_hub_publish_warns_of_a_key_whose_acl_shares_no_model_with_its_teams(
        hub_feed: _Feed, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As `policy apply`: the key may use no model (it narrows its team's ACL), so every
    request of it naming one is refused 403. Published all the same, with the warning."""
    doc = tmp_path / "p.yaml"
    doc.write_text("models: {gpt-4o: {}, llama-3-8b: {}}\n"
                   "teams: {t1: {models: ['llama-*']}}\n"
                   "keys: {k1: {team: t1, sha256: '" + "1" * 64 + "', models: ['gpt-*']}}\n")
    assert main(["hub", "publish", str(doc), "--bootstrap", "hub:9092"]) == 0
    out, err = capsys.readouterr()
    assert err == ("warning: keys.k1.models ['gpt-*'] shares no model with team t1's "
                   "['llama-*']: every request of k1 for a model will be refused 403\n")
    assert out == "published revision 1 for spoke *\n"


def test_the_hub_topics_replication_factor_is_taken_from_the_env_by_every_writer(
        hub_feed: _Feed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """GATEWAY_TOPIC_REPLICATION reaches each command that may create a hub topic: `hub
    publish` (the feed), `policy sync` (its status reports and its allowance follower's
    quota messages) and `hub allocate` (the quota topic). Unset: 1, as before."""
    from gateway.hub.allocator import Allocator
    from gateway.hub.sync import Syncer
    doc = tmp_path / "p.yaml"
    doc.write_text("models: {m: {}}\nteams: {t: {models: ['*']}}\n"
                   "keys: {k: {team: t, sha256: '" + "0" * 64 + "'}}\n")
    assert main(["hub", "publish", str(doc), "--bootstrap", "hub:9092"]) == 0
    assert hub_feed.replication == {POLICY_TOPIC: 1}
    monkeypatch.setenv("GATEWAY_TOPIC_REPLICATION", "3")
    hub_feed.replication.clear()
    assert main(["hub", "publish", str(doc), "--bootstrap", "hub:9092"]) == 0
    assert hub_feed.replication == {POLICY_TOPIC: 3}

    seen: dict[str, Any] = {}

    async def run_sync(settings: Settings, syncer_id: str,
                       extra: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
                       allowances: Any = None) -> None:
        seen.update(sync=settings.topic_replication,
                    follower=getattr(extra[0], "__self__", None).replication)  # type: ignore[union-attr]

    async def allocate(self: Allocator, stop: Any = None) -> None:
        seen.update(allocator=self.replication)

    monkeypatch.setattr("gateway.hub.sync.run_sync", run_sync)
    monkeypatch.setattr(Allocator, "run", allocate)
    monkeypatch.setenv("GATEWAY_REDIS_URL", "redis://127.0.0.1:1")
    assert main(["policy", "sync", "--id", "s1", "--bootstrap", "hub:9092"]) == 0
    assert main(["hub", "allocate", "--bootstrap", "hub:9092"]) == 0
    assert seen == {"sync": 3, "follower": 3, "allocator": 3}
    syncer = Syncer("s1", "sync-1", None, "hub:9092", tmp_path,  # type: ignore[arg-type]
                    replication=Settings().topic_replication)
    assert syncer.reporter.topic.replication == 3  # `run_sync` builds it so
