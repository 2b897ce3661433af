"""Key rotation (`keys rotate`, `keys.<id>.previous`): the old secret stays the same key,
with its limits and counters, until its grace ends; then the usual expiry check refuses it."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.authz.decision import Allow, Decision, Deny
from gateway.authz.engine import AdmissionSettings, Authorizer
from gateway.authz.request import AuthzRequest
from gateway.clock import FakeClock
from gateway.errors import PolicyError
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.policy import admin, key_edits, secrets
from gateway.policy.loader import dump_yaml, load, parse_doc, to_data
from gateway.policy.model import Policy

NOW = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)
NEW, OLD, OLDER = (f"sk-gw-k-{c * 43}" for c in "ABC")


def sha(secret: str) -> str:
    return secrets.digest(secret).hex()


def doc(key: dict[str, Any], **other_keys: dict[str, Any]) -> dict[str, Any]:
    return {"models": {"m": {}}, "teams": {"t": {"models": ["*"]}},
            "keys": {"k": {"team": "t", "sha256": sha(NEW), **key},
                     **{kid: {"team": "t", **k} for kid, k in other_keys.items()}}}


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_doc(json.dumps(data))
    return info.value.problems


# --- the schema ------------------------------------------------------------------------------


def test_previous_secrets_are_read_with_their_until() -> None:
    key = parse_doc(json.dumps(doc({"previous": [
        {"sha256": sha(OLD).upper(), "until": "2027-01-16T08:00:00Z"}]}))).keys["k"]
    assert [(p.sha256, p.until) for p in key.previous] == [
        (sha(OLD), datetime(2027, 1, 16, 8, 0, tzinfo=UTC))]
    assert parse_doc(json.dumps(doc({}))).keys["k"].previous == []


@pytest.mark.parametrize(("entry", "path", "words"), [
    ({"sha256": "abc", "until": "2027-01-16T08:00:00Z"}, "keys.k.previous.0.sha256",
     "pattern"),
    ({"sha256": sha(OLD), "until": "2027-01-16T08:00:00"}, "keys.k.previous.0.until",
     "timezone"),
    ({"sha256": sha(OLD)}, "keys.k.previous.0.until", "Field required"),
    ({"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z", "secret": "x"},
     "keys.k.previous.0.secret", "Extra inputs"),
], ids=["bad-digest", "naive-until", "no-until", "unknown-field"])
def test_a_bad_previous_entry_names_its_path(entry: dict[str, Any], path: str,
                                             words: str) -> None:
    [problem] = problems(doc({"previous": [entry]}))
    assert problem.startswith(f"{path}: ") and words in problem, problem


def test_at_most_four_previous_secrets() -> None:
    entries = [{"sha256": sha(f"s{i}"), "until": "2027-01-16T08:00:00Z"} for i in range(5)]
    parse_doc(json.dumps(doc({"previous": entries[:4]})))
    [problem] = problems(doc({"previous": entries}))
    assert problem.startswith("keys.k.previous: ") and "at most 4" in problem, problem


@pytest.mark.parametrize(("data", "expected"), [
    (doc({"previous": [{"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z"}]},
         other={"sha256": sha(OLD)}),
     "keys.k.previous.0.sha256: same digest as keys.other"),
    (doc({"previous": [{"sha256": sha(NEW), "until": "2027-01-16T08:00:00Z"}]}),
     "keys.k.previous.0.sha256: same digest as keys.k"),
    (doc({"previous": [{"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z"}]},
         other={"sha256": sha(OLDER),
                "previous": [{"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z"}]}),
     "keys.other.previous.0.sha256: same digest as keys.k.previous.0"),
    (doc({"previous": [{"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z"},
                       {"sha256": sha(OLD), "until": "2027-01-17T08:00:00Z"}]}),
     "keys.k.previous.1.sha256: same digest as keys.k.previous.0"),
], ids=["another-keys-current", "its-own-current", "another-keys-previous", "itself-twice"])
def test_a_digest_used_twice_is_refused_as_two_keys_are(data: dict[str, Any],
                                                        expected: str) -> None:
    assert problems(data) == [expected]


def test_the_document_round_trips_with_previous_secrets() -> None:
    d = parse_doc(json.dumps(doc({"previous": [
        {"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z"}]})))
    assert to_data(d)["keys"]["k"]["previous"] == [
        {"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z"}]
    assert parse_doc(dump_yaml(d)) == d
    assert parse_doc(orjson.dumps(to_data(d))) == d


# --- compiled: the old digest is the same key, ending at `until` -----------------------------


def test_an_old_digest_is_the_same_key_ending_at_until() -> None:
    policy = load(json.dumps(doc({"limits": {"tokens_per_day": 500}, "models": ["m"],
                                  "previous": [{"sha256": sha(OLD),
                                                "until": "2027-01-16T08:00:00Z"}]})))
    new = policy.keys_by_digest[secrets.digest(NEW)]
    old = policy.keys_by_digest[secrets.digest(OLD)]
    assert new is policy.keys["k"] and new.expires_at is None
    assert old.expires_at == datetime(2027, 1, 16, 8, 0, tzinfo=UTC).timestamp()
    assert (old.key_id, old.team, old.limits, old.key_acl, old.disabled) == (
        new.key_id, new.team, new.limits, new.key_acl, new.disabled)
    assert policy.tiers_for("m", old) == policy.tiers_for("m", new)  # one set of counters


def test_an_old_secret_never_outlives_its_key() -> None:
    policy = load(json.dumps(doc({"expires_at": "2027-01-15T12:00:00Z", "previous": [
        {"sha256": sha(OLD), "until": "2027-01-16T08:00:00Z"}]})))
    assert policy.keys_by_digest[secrets.digest(OLD)].expires_at == \
        datetime(2027, 1, 15, 12, 0, tzinfo=UTC).timestamp()


# --- enforced by the Check, with no code of its own ------------------------------------------


class Gate:
    def __init__(self, policy: Policy) -> None:
        self.clock = FakeClock(NOW.timestamp())
        limiter = MemoryLimiter()
        self.authz = Authorizer(lambda: policy, limiter, self.clock, AdmissionSettings(),
                                ledger=Ledger(limiter, self.clock, lease_ttl=30))
        self.n = 0

    async def check(self, secret: str, max_tokens: int = 1) -> Decision:
        self.n += 1
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens}
        return await self.authz.check(AuthzRequest(
            f"req-{self.n}", "POST", "/v1/chat/completions",
            {"authorization": f"Bearer {secret}"}, json.dumps(body).encode()))


def _grace_doc(**key: Any) -> str:
    return json.dumps(doc({"previous": [{"sha256": sha(OLD), "until": "2027-01-15T08:00:02Z"}],
                           **key}))


async def test_the_old_secret_is_the_key_until_its_grace_ends() -> None:
    gate = Gate(load(_grace_doc(limits={"tokens_per_day": 1000})))
    first = await gate.check(OLD, max_tokens=600)
    assert isinstance(first, Allow) and first.context.caller.key_id == "k"
    # the budget the old secret spent is the key's: the new one has only the rest
    d = await gate.check(NEW, max_tokens=600)
    assert isinstance(d, Deny) and (d.status, d.reason) == (429, "tokens_per_day"), d
    assert isinstance(await gate.check(NEW, max_tokens=100), Allow)
    gate.clock.advance(1.999)
    assert isinstance(await gate.check(OLD), Allow)
    gate.clock.advance(0.001)  # now == until: ended
    d = await gate.check(OLD)
    assert isinstance(d, Deny) and (d.status, d.code) == (401, "invalid_api_key")
    assert d.key_id == "k"  # its event names the key
    assert isinstance(await gate.check(NEW), Allow)


async def test_a_revoked_key_refuses_both_secrets() -> None:
    gate = Gate(load(_grace_doc(disabled=True)))
    for secret in (NEW, OLD):
        d = await gate.check(secret)
        assert isinstance(d, Deny) and d.status == 401


# --- keys rotate ------------------------------------------------------------------------------


@pytest.fixture
async def backend(tmp_path: Path) -> admin.FileBackend:
    b = admin.FileBackend(tmp_path / "policy.yaml")
    await admin.apply(b, json.dumps(doc({"limits": {"rps": 3}})).encode(), "test")
    return b


async def test_rotate_gives_a_new_secret_and_keeps_the_old_for_the_grace(
        backend: admin.FileBackend) -> None:
    done = await key_edits.rotate_key(backend, "k", "24h", now=NOW + timedelta(microseconds=5))
    assert done.key_id == "k" and done.revision == 2
    assert done.old_until == NOW + timedelta(hours=24, seconds=1)  # rounded up, as expiry
    assert done.secret.startswith("sk-gw-k-") and len(secrets.random_part(done.secret)) == 43
    rev, d = await backend.read()
    key = d.keys["k"]
    assert rev == 2 and key.sha256 == sha(done.secret)
    assert [(p.sha256, p.until) for p in key.previous] == [(sha(NEW), done.old_until)]
    assert key.limits.rps == 3 and key.team == "t"  # the rest of the key as it was
    policy = load(backend.path.read_bytes())
    assert policy.keys_by_digest[secrets.digest(NEW)].key_id == "k"
    assert policy.keys_by_digest[secrets.digest(done.secret)].key_id == "k"


async def test_rotate_prunes_the_secrets_whose_grace_ended(
        backend: admin.FileBackend) -> None:
    first = await key_edits.rotate_key(backend, "k", "1h", now=NOW)
    second = await key_edits.rotate_key(backend, "k", "2h", now=NOW + timedelta(minutes=30))
    _, d = await backend.read()
    assert [p.sha256 for p in d.keys["k"].previous] == [sha(NEW), sha(first.secret)]
    third = await key_edits.rotate_key(backend, "k", "2h", now=NOW + timedelta(minutes=61))
    rev, d = await backend.read()
    assert rev == 4  # each rotation its own revision
    assert [p.sha256 for p in d.keys["k"].previous] == [sha(first.secret),
                                                        sha(second.secret)]
    assert d.keys["k"].sha256 == sha(third.secret)


async def test_no_old_secret_outlives_the_last_rotations_grace(
        backend: admin.FileBackend) -> None:
    """Rotating again with a shorter grace ends the older secrets by then too: the newest
    old secret never ends before an older one."""
    first = await key_edits.rotate_key(backend, "k", "24h", now=NOW)
    await key_edits.rotate_key(backend, "k", "1h", now=NOW + timedelta(minutes=10))
    _, d = await backend.read()
    end = NOW + timedelta(minutes=70)
    assert [(p.sha256, p.until) for p in d.keys["k"].previous] == [
        (sha(NEW), end), (sha(first.secret), end)]
    await key_edits.rotate_key(backend, "k", "48h", now=NOW + timedelta(minutes=20))
    _, d = await backend.read()
    assert [p.until for p in d.keys["k"].previous] == [
        end, end, NOW + timedelta(minutes=20, hours=48)]  # a longer grace extends none


async def test_a_grace_of_zero_ends_every_old_secret_at_once(
        backend: admin.FileBackend) -> None:
    await key_edits.rotate_key(backend, "k", "1h", now=NOW)
    for grace in ("0", "0s"):
        done = await key_edits.rotate_key(backend, "k", grace, now=NOW)
        assert done.old_until is None
        _, d = await backend.read()
        assert d.keys["k"].previous == [] and d.keys["k"].sha256 == sha(done.secret)
        assert "previous" not in backend.path.read_text()
        policy = load(backend.path.read_bytes())
        assert set(policy.keys_by_digest) == {secrets.digest(done.secret)}


async def test_a_fifth_old_secret_in_its_grace_is_refused(backend: admin.FileBackend) -> None:
    for i in range(4):
        await key_edits.rotate_key(backend, "k", "1h", now=NOW + timedelta(minutes=i))
    before = backend.path.read_bytes()
    with pytest.raises(ValueError, match=r"already has 4 old secrets .* ends "
                                         r"2027-01-15T09:00:00Z.*--grace 0"):
        await key_edits.rotate_key(backend, "k", "1h", now=NOW + timedelta(minutes=5))
    assert backend.path.read_bytes() == before  # nothing published


async def test_rotate_refuses_a_bad_grace_or_an_unknown_key(
        backend: admin.FileBackend) -> None:
    with pytest.raises(ValueError, match="bad duration"):
        await key_edits.rotate_key(backend, "k", "soon")
    with pytest.raises(ValueError, match="bad duration"):
        await key_edits.rotate_key(backend, "k", "-1h")
    with pytest.raises(KeyError):
        await key_edits.rotate_key(backend, "nope", "1h")


# --- what the operator sees: never a secret ----------------------------------------------------


async def test_keys_list_and_show_say_until_when_an_old_secret_is_valid(
        backend: admin.FileBackend) -> None:
    from gateway import keys_show
    done = await key_edits.rotate_key(backend, "k", "1h", now=NOW)
    rev, d = await backend.read()
    [row] = key_edits.key_rows(d, now=NOW)
    assert row["old_secret_until"] == "2027-01-15T09:00:00Z"
    assert key_edits.key_rows(d, now=NOW + timedelta(hours=1))[0]["old_secret_until"] == ""
    policy = Policy.compile(d, rev)
    data = keys_show.as_data(policy, "k", [], NOW.timestamp(), counters=False)
    assert data["old_secrets_until"] == ["2027-01-15T09:00:00Z"]
    assert "old secret still valid until 2027-01-15T09:00:00Z" in keys_show.table(data)
    text = repr(row) + orjson.dumps(data).decode() + keys_show.table(data)
    for secret in (NEW, done.secret):
        assert sha(secret) not in text and secrets.random_part(secret)[:12] not in text


def test_the_cli_prints_the_new_secret_once_and_the_old_ones_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(doc({})))
    flags = ["--policy-file", str(path)]
    assert main(["keys", "rotate", "k", "--grace", "2h", *flags]) == 0
    out = capsys.readouterr()
    lines = dict(line.split(":", 1) for line in out.out.splitlines())
    assert lines["key_id"].strip() == "k" and lines["revision"].strip() == "1"
    secret = lines["secret"].strip()
    assert parse_doc(path.read_bytes()).keys["k"].sha256 == sha(secret)
    assert lines["previous"].strip().startswith("valid until 20")
    assert "shown once" in out.err
    assert main(["keys", "list", *flags]) == 0
    listed = capsys.readouterr().out
    assert "OLD SECRET UNTIL" in listed and lines["previous"].split("until ")[1] in listed
    assert main(["keys", "rotate", "k", "--grace", "0", *flags]) == 0
    assert "previous: ended now" in capsys.readouterr().out
    assert main(["keys", "rotate", "nope", *flags]) == 2
    assert main(["keys", "rotate", "k", "--grace", "1x", *flags]) == 2
    assert "bad duration" in capsys.readouterr().err
    assert main(["keys", "rotate", secret, *flags]) == 2  # a secret where the id goes
    assert secret not in capsys.readouterr().err
