"""Settings refused at start, with the setting named, rather than misbehaving later."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


@pytest.mark.parametrize(("field", "value", "says"), [
    ("spoke", "eu/west", "must not contain '/'"),
    ("instance_id", "host/1", "must not contain '/'"),
    ("spoke", "*", "must name this spoke"),
    ("spoke", " ", "must name this spoke"),
    ("status_interval_s", 0, "greater than 0"),
])
def test_a_value_the_hub_contract_cannot_carry_is_refused(field: str, value: object,
                                                          says: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(**{field: value})
    assert field in str(err.value) and says in str(err.value)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("lease_ttl_s", float("nan"), "finite number"),
    ("redis_deadline_ms", float("inf"), "finite number"),
    ("redis_deadline_ms", 0, "greater than 0"),
    ("policy_recheck_s", 0, "greater than 0"),
    ("record_heartbeat_s", -1, "greater than 0"),
    ("orphan_grace_ms", -5, "greater than or equal to 0"),
    ("reserve_cap_tokens", -1, "greater than or equal to 0"),
    ("max_message_bytes", 0, "greater than 0"),
])
def test_a_duration_or_size_that_cannot_work_is_refused(field: str, value: object,
                                                        says: str) -> None:
    """A NaN lease TTL, a zero deadline (every Check a 503) or a zero re-check period (a busy
    loop) was taken as given: each is refused at start, named."""
    with pytest.raises(ValidationError) as err:
        Settings(**{field: value})
    assert field in str(err.value) and says in str(err.value)


def test_the_defaults_and_ordinary_names_are_taken() -> None:
    s = Settings(spoke="eu-west-1", instance_id="host-7")
    assert (s.spoke, s.instance_id, s.status_interval_s) == ("eu-west-1", "host-7", 10.0)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("workers", 0, "greater than or equal to 1"),
    ("workers", -2, "greater than or equal to 1"),
    ("door_workers", -1, "greater than or equal to 0"),
])
def test_no_worker_at_all_or_a_negative_count_is_refused(field: str, value: int,
                                                         says: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(**{field: value})
    assert field in str(err.value) and says in str(err.value)


@pytest.mark.parametrize(("env", "argv", "says"), [
    ({"GATEWAY_DOOR_WORKERS": "-1"}, [], "GATEWAY_DOOR_WORKERS: Input should be greater"),
    ({}, ["--door-workers", "-1"], "GATEWAY_DOOR_WORKERS: Input should be greater"),
    ({"GATEWAY_WORKERS": "0"}, [], "GATEWAY_WORKERS: Input should be greater"),
    ({"GATEWAY_LEASE_TTL_S": "nan"}, [], "GATEWAY_LEASE_TTL_S: Input should be a finite"),
    ({"GATEWAY_REDIS_DEADLINE_MS": "0"}, [], "GATEWAY_REDIS_DEADLINE_MS: Input should be greater"),
    # embedded: no GATEWAY_REDIS_URL
    ({"GATEWAY_DOOR_WORKERS": "1"}, [], "GATEWAY_DOOR_WORKERS needs Redis"),
    ({}, ["--door-workers", "2"], "GATEWAY_DOOR_WORKERS needs Redis"),
    ({"GATEWAY_DOOR_WORKERS": "1", "GATEWAY_REDIS_URL": "redis://127.0.0.1:1",
      "GATEWAY_AUTHZ_HTTP_LISTEN": ""}, [], "GATEWAY_DOOR_WORKERS needs the HTTP door"),
    ({"GATEWAY_REDIS_URL": "redis://127.0.0.1:1"},
     ["--door-workers", "1", "--authz-http-listen", ""], "needs the HTTP door"),
])
def test_serve_refuses_door_workers_it_cannot_run_before_binding_anything(
        env: dict[str, str], argv: list[str], says: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway import cli
    from gateway.server import app, workers

    def serving(*_: object) -> None:
        raise AssertionError("serve went on to bind its ports")

    monkeypatch.setattr(workers, "run_workers", serving)
    monkeypatch.setattr(app, "run", serving)
    for name in ("GATEWAY_REDIS_URL", "GATEWAY_WORKERS", "GATEWAY_DOOR_WORKERS",
                 "GATEWAY_AUTHZ_HTTP_LISTEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", *argv])
    assert isinstance(exit_.value.code, str) and says in exit_.value.code, exit_.value.code


def test_workers_of_names_each_process_and_what_it_serves() -> None:
    from gateway.server.workers import workers_of
    assert workers_of(Settings()) == {"w0": "all"}
    assert workers_of(Settings(workers=3)) == {"w0": "all", "w1": "all", "w2": "all"}
    assert workers_of(Settings(door_workers=1)) == {"w0": "records", "d0": "door"}
    assert workers_of(Settings(workers=2, door_workers=3)) == {
        "w0": "records", "w1": "records", "d0": "door", "d1": "door", "d2": "door"}


@pytest.mark.parametrize("value", [0, -1])
def test_a_replication_factor_below_one_is_refused_naming_the_setting(
        value: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub topics' replication factor: -1 (a broker's default) cannot be asked through
    aiokafka, 0 keeps no copy. Refused at start with one line naming the setting."""
    from gateway.settings import cli_settings
    with pytest.raises(ValidationError) as err:
        Settings(topic_replication=value)
    assert "topic_replication" in str(err.value) and "must be 1 or more" in str(err.value)
    monkeypatch.setenv("GATEWAY_TOPIC_REPLICATION", str(value))
    with pytest.raises(SystemExit) as stop:
        cli_settings(argparse.Namespace())
    assert str(stop.value).startswith("gateway: bad settings: GATEWAY_TOPIC_REPLICATION: ")
    assert "must be 1 or more" in str(stop.value) and f"not {value}" in str(stop.value)


def test_the_replication_factor_is_one_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().topic_replication == 1  # NewTopic(topic, 1, 1), as before
    monkeypatch.setenv("GATEWAY_TOPIC_REPLICATION", "3")
    assert Settings().topic_replication == 3


@pytest.mark.parametrize("value", ["loud", "verbose", "", "5"])
def test_a_log_level_that_names_no_level_is_refused(value: str) -> None:
    """GATEWAY_LOG_LEVEL=loud was taken as `info` without a word: an operator asking for
    debug logs by a misspelt name got none and no hint why."""
    with pytest.raises(ValidationError) as err:
        Settings(log_level=value)
    assert "log_level" in str(err.value) and "debug, info, warning, error" in str(err.value)


@pytest.mark.parametrize("value", ["debug", "INFO", "Warning", "error", "critical"])
def test_the_log_levels_by_name_in_any_case_are_taken(value: str) -> None:
    assert Settings(log_level=value).log_level == value


def test_an_empty_policy_file_setting_is_unset() -> None:
    """GATEWAY_POLICY_FILE= (set, empty) was the path '.': serve started reading the
    working directory as its policy, logging `policy_file_unreadable` every poll. Empty is
    unset, as for GATEWAY_REDIS_URL and GATEWAY_KAFKA_BOOTSTRAP."""
    assert Settings(policy_file="").policy_file is None


@pytest.mark.parametrize("field", ["spool_dir", "usage_jsonl", "sync_state_dir"])
def test_an_empty_path_is_refused(field: str) -> None:
    """An empty GATEWAY_USAGE_JSONL was the path '.', a directory: every delivery failed for
    ever; an empty spool or state directory was the working directory itself."""
    with pytest.raises(ValidationError) as err:
        Settings(**{field: ""})
    assert field in str(err.value) and "must name a path" in str(err.value)


@pytest.mark.parametrize("value", ["", "llm usage", "llm/usage", "x" * 250])
def test_a_usage_topic_kafka_cannot_name_is_refused(value: str) -> None:
    """GATEWAY_USAGE_TOPIC= (empty) or with a space started serving, and every delivery of
    every event then failed for ever: Kafka names a topic with 1 to 249 of [a-zA-Z0-9._-]."""
    with pytest.raises(ValidationError) as err:
        Settings(usage_topic=value)
    assert "usage_topic" in str(err.value) and "Kafka topic name" in str(err.value)


@pytest.mark.parametrize("value", [".", ".."])
def test_a_usage_topic_of_dots_alone_is_refused(value: str) -> None:
    """Kafka refuses a topic named '.' or '..' (InvalidTopicException), though each is made
    of its characters: it started serving, and every delivery then failed for ever."""
    with pytest.raises(ValidationError) as err:
        Settings(usage_topic=value)
    assert "usage_topic" in str(err.value) and "Kafka topic name" in str(err.value)


def test_a_usage_topic_of_kafkas_characters_is_taken() -> None:
    assert Settings(usage_topic="llm.usage_v1-eu").usage_topic == "llm.usage_v1-eu"


@pytest.mark.parametrize(("url", "says"), [
    ("redis://:secret-pw@127.0.0.1:6379/notadb", "database"),
    ("redis://127.0.0.1:6379/0/1", "database"),
    ("rediss://:secret-pw@/0", "names no host"),
    ("redis://", "names no host"),
])
def test_a_redis_url_redis_py_would_read_otherwise_is_refused(url: str, says: str) -> None:
    """redis-py takes a database path that is not a number as database 0, and a URL with no
    host as localhost:6379: an operator's typo served another Redis, or another database of
    it, without a word. Refused at start; the password is never repeated."""
    with pytest.raises(ValidationError) as err:
        Settings(redis_url=url)
    assert "redis_url" in str(err.value) and says in str(err.value)
    assert "secret-pw" not in str(err.value)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://h:1/15",
    "rediss://user:pw@h:1/0?ssl_cert_reqs=none", "redis://h:1?db=3",
    "unix:///tmp/redis.sock?db=2", "unix:///tmp/redis.sock",
])
def test_the_redis_url_forms_the_readme_lists_are_taken(url: str) -> None:
    assert Settings(redis_url=url).redis_url == url


@pytest.mark.parametrize("field", ["kafka_bootstrap", "hub_bootstrap"])
@pytest.mark.parametrize("value", ["127.0.0.1:abc", "h:1:2", "h:0", "h:70000", "a:9092,,b:9092",
                                   "kafka one:9092"])
def test_a_bootstrap_that_is_not_hosts_and_ports_is_refused(field: str, value: str) -> None:
    """GATEWAY_KAFKA_BOOTSTRAP=127.0.0.1:abc started serving: the status reporter crashed on
    it (`background_task_crashed`) and every delivery would have failed for ever."""
    with pytest.raises(ValidationError) as err:
        Settings(**{field: value})
    assert field in str(err.value) and "HOST[:PORT]" in str(err.value)


@pytest.mark.parametrize("value", ["127.0.0.1:9092", "k1:9092, k2:9093", "kafka", "[::1]:9092",
                                   "broker-0.kafka.svc.cluster.local:9094"])
def test_a_bootstrap_of_hosts_and_ports_is_taken(value: str) -> None:
    assert Settings(kafka_bootstrap=value, hub_bootstrap=value).kafka_bootstrap == value
