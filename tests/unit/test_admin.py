"""Operator actions on a policy file: apply, keys create / revoke / list, durations."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from gateway.errors import PolicyError
from gateway.policy import admin, key_edits, secrets
from gateway.policy.loader import load, parse_doc
from gateway.policy.store import RevisionConflict

FIXTURES = Path(__file__).parent.parent / "fixtures" / "policies"
VALID = (FIXTURES / "valid.yaml").read_bytes()
SECRET_DIGEST = secrets.digest("test").hex()


@pytest.fixture
def backend(tmp_path: Path) -> admin.FileBackend:
    return admin.FileBackend(tmp_path / "policy.yaml")


async def test_read_of_missing_file_is_empty_revision_zero(backend: admin.FileBackend) -> None:
    rev, doc = await backend.read()
    assert rev == 0 and doc.keys == {} and doc.teams == {}


async def test_apply_writes_a_revision(backend: admin.FileBackend) -> None:
    assert (await admin.apply(backend, VALID, "valid.yaml")).revision == 1
    rev, doc = await backend.read()
    assert rev == 1
    assert doc.model_copy(update={"revision": None}) == parse_doc(VALID)
    assert yaml.safe_load(backend.path.read_text())["revision"] == 1
    # the file itself is a valid, loadable policy at that revision
    assert load(backend.path.read_bytes()).revision == 1

    assert (await admin.apply(backend, VALID, "valid.yaml")).revision == 2
    assert (await backend.read())[0] == 2


async def test_apply_keeps_a_newer_revision_from_the_document(
    backend: admin.FileBackend,
) -> None:
    assert (await admin.apply(backend, VALID + b"revision: 40\n", "x")).revision == 40
    # an older revision number: exported before someone else published; refused
    with pytest.raises(admin.ApplyRefused, match="based on revision 3, but revision 40"):
        await admin.apply(backend, VALID + b"revision: 3\n", "x")
    assert (await backend.read())[0] == 40


async def test_apply_invalid_publishes_nothing(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    before = backend.path.read_bytes()
    bad = (FIXTURES / "bad_negative_rps.yaml").read_bytes()
    with pytest.raises(PolicyError) as info:
        await admin.apply(backend, bad, "bad.yaml")
    assert info.value.problems[0].startswith("keys.key_7Hq2.limits.rps:")
    assert backend.path.read_bytes() == before
    assert [p.name for p in backend.path.parent.iterdir()] == ["policy.yaml"]  # no temp left


async def test_create_key(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    new = await key_edits.create_key(backend, "team-a", models=["llama-*"],
                                 limits={"rps": 3, "concurrency": None, "tokens_per_day": 10})

    assert new.revision == 2
    assert re.fullmatch(rf"sk-gw-{new.key_id}-[A-Za-z0-9_-]{{43}}", new.secret)
    rev, doc = await backend.read()
    assert rev == 2
    entry = doc.keys[new.key_id]
    assert entry.sha256 == secrets.digest(new.secret).hex()
    assert (entry.team, entry.models, entry.expires_at) == ("team-a", ["llama-*"], None)
    assert (entry.limits.rps, entry.limits.tokens_per_day) == (3.0, 10)
    assert entry.limits.concurrency is None
    assert new.secret not in backend.path.read_text()  # only the digest is stored
    assert "key_7Hq2" in doc.keys  # the existing key is kept

    policy = load(backend.path.read_bytes())
    rec = policy.keys_by_digest[secrets.digest(new.secret)]
    assert rec.key_id == new.key_id
    assert rec.may_use("llama-3") and not rec.may_use("qwen3-coder")


async def test_create_key_with_id_and_expiry(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    before = datetime.now(UTC)
    new = await key_edits.create_key(backend, "team-a", key_id="ci_bot", expires_in="30d")
    assert new.key_id == "ci_bot" and new.secret.startswith("sk-gw-ci_bot-")
    expires = (await backend.read())[1].keys["ci_bot"].expires_at
    assert expires is not None
    after = datetime.now(UTC) + timedelta(days=30, seconds=1)
    assert before + timedelta(days=30) <= expires <= after
    assert expires.microsecond == 0  # whole seconds: `keys list`'s EXPIRES column holds it


def test_expiry_rounds_up_to_a_whole_second() -> None:
    now = datetime(2026, 12, 6, 20, 44, 58, 445770, tzinfo=UTC)
    assert key_edits.expiry("30d", now) == datetime(2027, 1, 5, 20, 44, 59, tzinfo=UTC)
    assert key_edits.expiry("1h", now.replace(microsecond=0)) == datetime(2026, 12, 6, 21, 44, 58,
                                                                       tzinfo=UTC)


async def test_create_key_twice_with_same_id_fails(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    with pytest.raises(ValueError, match="key_7Hq2 already exists"):
        await key_edits.create_key(backend, "team-a", key_id="key_7Hq2")
    assert (await backend.read())[0] == 1



async def test_create_key_for_unknown_team_is_refused(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    before = backend.path.read_bytes()
    with pytest.raises((PolicyError, ValueError)):
        await key_edits.create_key(backend, "no-such-team")
    assert backend.path.read_bytes() == before
    await backend.read()  # still readable


async def test_create_key_for_a_team_the_policy_lacks_says_which_teams_it_has(
        backend: admin.FileBackend) -> None:
    """The README's first steps (`keys create` needs a team the policy names): the refusal
    named the random key id the command had drawn (`edited policy:
    keys.key_62d3ccc6.team: unknown team 'nope'`), a path in no file the operator has."""
    with pytest.raises(ValueError) as none_yet:
        await key_edits.create_key(backend, "team-a")
    assert str(none_yet.value) == (
        "no team 'team-a': no policy yet (revision 0): `gateway policy apply FILE` makes "
        "one, with its teams")
    await admin.apply(backend, VALID, "valid.yaml")
    with pytest.raises(ValueError) as missing:
        await key_edits.create_key(backend, "no-such-team")
    assert str(missing.value) == (
        "no team 'no-such-team' in revision 1 (its teams: team-a): add it with "
        "`gateway policy apply`, or pick one of those")
    assert (await backend.read())[0] == 1


async def test_revoke_key_disables_and_bumps_revision(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    assert await key_edits.revoke_key(backend, "key_7Hq2") == key_edits.KeyEdit("key_7Hq2", 2, True)
    rev, doc = await backend.read()
    assert rev == 2 and doc.keys["key_7Hq2"].disabled is True
    assert doc.keys["key_7Hq2"].sha256 == SECRET_DIGEST  # the entry stays, disabled
    assert load(backend.path.read_bytes()).keys["key_7Hq2"].disabled


async def test_revoking_a_revoked_key_changes_nothing(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    await key_edits.revoke_key(backend, "key_7Hq2")
    before = backend.path.read_bytes()
    assert await key_edits.revoke_key(backend, "key_7Hq2") == key_edits.KeyEdit(
        "key_7Hq2", 2, False)
    assert backend.path.read_bytes() == before  # no new revision


async def test_enable_brings_a_revoked_key_back(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    await key_edits.revoke_key(backend, "key_7Hq2")
    assert await key_edits.enable_key(backend, "key_7Hq2") == key_edits.KeyEdit("key_7Hq2", 3, True)
    policy = load(backend.path.read_bytes())
    assert not policy.keys["key_7Hq2"].disabled
    assert policy.keys["key_7Hq2"].key_id == "key_7Hq2"
    assert (await key_edits.enable_key(backend, "key_7Hq2")).changed is False


async def test_update_key_limits_models_and_expiry(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")  # key_7Hq2: rps 2, concurrency 4, tpd 2M
    when = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    done = await key_edits.update_key(backend, "key_7Hq2",
                                  limits={"rps": 5, "concurrency": None, "tokens_per_minute": 900},
                                  models=["llama-*"], expires_at=when)
    assert done == key_edits.KeyEdit("key_7Hq2", 2, True)
    key = (await backend.read())[1].keys["key_7Hq2"]
    assert (key.limits.rps, key.limits.concurrency, key.limits.tokens_per_minute,
            key.limits.tokens_per_day) == (5, None, 900, 2000000)  # what was not named is kept
    assert (key.models, key.expires_at) == (["llama-*"], when)
    assert key.sha256 == SECRET_DIGEST  # the same secret still works

    done = await key_edits.update_key(backend, "key_7Hq2", models=None, expires_at=None)
    key = (await backend.read())[1].keys["key_7Hq2"]
    assert done.revision == 3 and key.models is None and key.expires_at is None
    assert (await key_edits.update_key(backend, "key_7Hq2", limits={"rps": 5})).changed is False


async def test_update_key_is_validated_as_apply_is(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    before = backend.path.read_bytes()
    with pytest.raises(PolicyError, match=r"keys.key_7Hq2.models.0: model 'gpt-9' matches no"):
        await key_edits.update_key(backend, "key_7Hq2", models=["gpt-9"])
    with pytest.raises(PolicyError, match=r"keys.key_7Hq2.limits.rps"):
        await key_edits.update_key(backend, "key_7Hq2", limits={"rps": -1})
    with pytest.raises(ValueError, match="unknown limit 'rsp'"):
        await key_edits.update_key(backend, "key_7Hq2", limits={"rsp": 1})
    with pytest.raises(KeyError):
        await key_edits.update_key(backend, "key_nope", limits={"rps": 1})
    # a burst asked for where there is no rate: said, not dropped ("nothing changed")
    with pytest.raises(ValueError, match="a burst needs an rps limit"):
        await key_edits.update_key(backend, "key_7Hq2", limits={"rps": None, "burst": 3})
    assert backend.path.read_bytes() == before
    # the rate removed, its burst goes with it
    await key_edits.update_key(backend, "key_7Hq2", limits={"rps": 5, "burst": 3})
    await key_edits.update_key(backend, "key_7Hq2", limits={"rps": None})
    assert (await backend.read())[1].keys["key_7Hq2"].limits.burst is None


async def test_create_key_naming_an_unknown_model_is_refused(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    with pytest.raises(PolicyError, match=r"keys\.\w+\.models\.0: model 'qwen3' matches no"):
        await key_edits.create_key(backend, "team-a", models=["qwen3"])
    assert (await backend.read())[0] == 1


async def test_revoke_unknown_key(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    with pytest.raises(KeyError):
        await key_edits.revoke_key(backend, "key_nope")
    assert (await backend.read())[0] == 1



async def test_file_write_from_stale_read_is_a_conflict(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    rev, doc = await backend.read()  # operator 1 reads revision 1
    await key_edits.create_key(backend, "team-a", key_id="other_op")  # operator 2 -> revision 2
    with pytest.raises(RevisionConflict):
        await backend.write(doc, rev)  # operator 1 writes what it read: would drop other_op


def test_key_rows_never_show_secrets_or_digests() -> None:
    other = "1" * 64
    doc = parse_doc(VALID + f"""\
  key_off:
    team: team-a
    sha256: "{other}"
    disabled: true
  key_new:
    team: team-a
    sha256: "{"2" * 64}"
    expires_at: 2030-01-01T00:00:00Z
""".encode())
    rows = key_edits.key_rows(doc, now=datetime(2028, 1, 1, tzinfo=UTC))

    by_id = {r["key_id"]: r for r in rows}
    assert set(by_id) == {"key_7Hq2", "key_off", "key_new"}
    assert by_id["key_7Hq2"]["state"] == "expired"  # expired 2027-01-01
    assert by_id["key_off"]["state"] == "disabled"
    assert by_id["key_new"]["state"] == "active"
    assert by_id["key_7Hq2"]["models"] == "qwen3-coder"
    assert by_id["key_new"]["models"] == "(team)"
    assert by_id["key_new"]["expires_at"] == "2030-01-01T00:00:00Z"  # as keys show writes it
    for row in rows:
        assert "sha256" not in row and "secret" not in row
        text = repr(row)
        for digest in (SECRET_DIGEST, other, "2" * 64):
            assert digest not in text and digest[:16] not in text


async def test_key_rows_after_create_never_show_the_secret(backend: admin.FileBackend) -> None:
    await admin.apply(backend, VALID, "valid.yaml")
    new = await key_edits.create_key(backend, "team-a")
    rows = key_edits.key_rows((await backend.read())[1])
    text = repr(rows)
    assert new.key_id in text
    assert new.secret not in text
    assert secrets.random_part(new.secret)[:12] not in text
    assert secrets.digest(new.secret).hex() not in text


@pytest.mark.parametrize(("text", "delta"), [
    ("30d", timedelta(days=30)),
    ("12h", timedelta(hours=12)),
    ("90m", timedelta(minutes=90)),
    ("45s", timedelta(seconds=45)),
    ("2w", timedelta(weeks=2)),
    ("1.5h", timedelta(minutes=90)),
])
def test_parse_duration(text: str, delta: timedelta) -> None:
    assert key_edits.parse_duration(text) == delta


@pytest.mark.parametrize("text", ["", "30", "d", "30x", "thirty days", "3 0d", "nand"])
def test_parse_duration_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="bad duration"):
        key_edits.parse_duration(text)



@pytest.mark.parametrize("text", ["-1d", "infd", "1e12d"])
def test_parse_duration_rejects_negative_and_unbounded(text: str) -> None:
    with pytest.raises(ValueError, match="bad duration"):
        key_edits.parse_duration(text)


# --- policy apply through the CLI: no spoke taken down by accident (issue 11) ----------------


def cli(*argv: str) -> int:
    from gateway.cli import main
    return main(list(argv))


def test_designs_example_applies_and_its_glob_ahead_of_any_model_is_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    assert cli("policy", "apply", str(FIXTURES / "design_example.yaml"),
               "--policy-file", str(policy)) == 0
    captured = capsys.readouterr()
    assert "applied revision 1" in captured.out
    assert ("warning: teams.team-a.models.1: glob 'llama-*' matches no model in `models` "
            "(qwen3-coder) yet") in captured.err
    assert parse_doc(policy.read_bytes()).teams["team-a"].models == ["qwen3-coder", "llama-*"]


def test_a_key_edit_warns_of_its_own_acl_glob_not_of_its_neighbours(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """keys create/update name a glob of the key's own that matches no model yet (a typo,
    perhaps), as policy apply does; a team's such glob is policy apply's to name."""
    policy = tmp_path / "policy.yaml"
    assert cli("policy", "apply", str(FIXTURES / "design_example.yaml"),
               "--policy-file", str(policy)) == 0
    capsys.readouterr()
    assert cli("keys", "create", "--team", "team-a", "--key-id", "key_g", "--models",
               "qwen3-*,mistral-*", "--policy-file", str(policy)) == 0
    err = capsys.readouterr().err
    assert ("warning: keys.key_g.models.1: glob 'mistral-*' matches no model in `models` "
            "(qwen3-coder) yet") in err
    assert "llama" not in err
    assert cli("keys", "update", "key_g", "--models", "qwen3-coder", "--policy-file",
               str(policy)) == 0
    assert "warning" not in capsys.readouterr().err
    assert cli("keys", "update", "key_g", "--models", "llama-*", "--policy-file",
               str(policy)) == 0
    assert "warning: keys.key_g.models.0: glob 'llama-*'" in capsys.readouterr().err


def test_an_empty_document_is_refused_unless_asked(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    src = tmp_path / "in.yaml"
    src.write_bytes(VALID)
    assert cli("policy", "apply", str(src), "--policy-file", str(policy)) == 0
    before = policy.read_bytes()
    for empty in (b"", b"{}\n", b"models: {}\n"):
        src.write_bytes(empty)
        assert cli("policy", "apply", str(src), "--policy-file", str(policy), "--prune") == 2
        assert "--allow-empty" in capsys.readouterr().err
        assert policy.read_bytes() == before  # nothing published
    src.write_bytes(b"{}\n")
    assert cli("policy", "apply", str(src), "--policy-file", str(policy), "--prune",
               "--allow-empty") == 0


def test_a_key_whose_acl_shares_no_model_with_its_teams_is_applied_with_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The key narrows its team's ACL: k1 may use no model, so every request of it naming
    one is refused 403. It was accepted without a word; it is still accepted (on purpose,
    perhaps), with a warning naming both ACLs. k2 shares a model, k3 has no ACL of its own,
    k4 is revoked: none of them is named."""
    policy, src = tmp_path / "policy.yaml", tmp_path / "in.yaml"
    src.write_text(f"""
models: {{gpt-4o: {{}}, llama-3-8b: {{}}}}
teams: {{t1: {{models: ['llama-*']}}}}
keys:
  k1: {{team: t1, sha256: "{SECRET_DIGEST}", models: ['gpt-*']}}
  k2: {{team: t1, sha256: "{'2' * 64}", models: ['gpt-*', llama-3-8b]}}
  k3: {{team: t1, sha256: "{'3' * 64}"}}
  k4: {{team: t1, sha256: "{'4' * 64}", models: [gpt-4o], disabled: true}}
""")
    warning = ("warning: keys.k1.models ['gpt-*'] shares no model with team t1's "
               "['llama-*']: every request of k1 for a model will be refused 403\n")
    assert cli("policy", "apply", str(src), "--policy-file", str(policy), "--dry-run") == 0
    out, err = capsys.readouterr()
    assert err == warning and "dry run: nothing published" in out
    assert cli("policy", "apply", str(src), "--policy-file", str(policy)) == 0
    out, err = capsys.readouterr()
    assert err == warning and "applied revision 1" in out
    assert "k1" in policy.read_text()
    src.write_bytes(VALID)  # the fixture's keys share their teams' models: no warning
    assert cli("policy", "apply", str(src), "--policy-file", str(policy), "--prune") == 0
    assert capsys.readouterr().err == ""


def test_keys_made_with_keys_create_are_not_dropped_silently(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy, src = tmp_path / "policy.yaml", tmp_path / "in.yaml"
    src.write_bytes(VALID)
    assert cli("policy", "apply", str(src), "--policy-file", str(policy)) == 0
    assert cli("keys", "create", "--team", "team-a", "--policy-file", str(policy)) == 0
    made = re.search(r"sk-gw-(\w+)-", capsys.readouterr().out)
    assert made is not None
    assert cli("policy", "apply", str(src), "--policy-file", str(policy), "--dry-run") == 2
    out, err = capsys.readouterr()
    assert f"  - keys.{made.group(1)}" in out and "dry run: nothing published" in out
    assert "--prune" in err
    assert cli("policy", "apply", str(src), "--policy-file", str(policy), "--dry-run",
               "--prune") == 0
    assert cli("policy", "apply", str(src), "--policy-file", str(policy)) == 2
    assert made.group(1) in capsys.readouterr().err and made.group(1) in policy.read_text()
    assert cli("policy", "apply", str(src), "--policy-file", str(policy), "--prune") == 0
    assert made.group(1) not in policy.read_text()


def test_show_edit_apply_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy, src = tmp_path / "policy.yaml", tmp_path / "in.yaml"
    src.write_bytes(VALID)
    assert cli("policy", "apply", str(src), "--policy-file", str(policy)) == 0
    capsys.readouterr()
    assert cli("policy", "show", "--policy-file", str(policy)) == 0
    exported = capsys.readouterr().out
    assert "revision: 1" in exported
    edited = tmp_path / "edited.yaml"
    edited.write_text(exported.replace("team-a:", "team-a:\n    # edited\n", 1))
    doc = yaml.safe_load(exported)
    doc["models"]["brand-new"] = {}
    edited.write_text(yaml.safe_dump(doc))
    assert cli("policy", "apply", str(edited), "--policy-file", str(policy)) == 0
    out = capsys.readouterr().out
    assert "  + models.brand-new" in out and "applied revision 2" in out
    # the same export, applied again after revision 2: it would undo that change
    assert cli("policy", "apply", str(edited), "--policy-file", str(policy)) == 2
    assert "based on revision 1, but revision 2" in capsys.readouterr().err


def test_keys_mint_makes_an_entry_a_hand_written_policy_can_use(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("keys", "mint", "ops_bot", "--team", "team-a") == 0
    out = capsys.readouterr().out
    secret = re.search(r"secret:\s+(\S+)", out)
    entry = out.split("(under keys:):\n", 1)[1]
    assert secret is not None
    src = tmp_path / "hand.yaml"
    src.write_text("models: {m: {}}\nteams: {team-a: {models: ['*']}}\nkeys:\n" + entry)
    policy = tmp_path / "policy.yaml"
    assert cli("policy", "apply", str(src), "--policy-file", str(policy)) == 0
    assert load(policy.read_bytes()).keys_by_digest[secrets.digest(secret.group(1))].key_id \
        == "ops_bot"


def test_the_key_id_rule_is_said_in_words(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("keys", "mint", "has-hyphen") == 2
    assert "no '-'" in capsys.readouterr().err
    with pytest.raises(PolicyError, match="no '-'"):
        load(b"teams: {t: {}}\nkeys: {a-b: {team: t, sha256: '" + b"0" * 64 + b"'}}\n")


def test_every_flag_of_every_command_says_what_it_is_and_its_default() -> None:
    import argparse

    from gateway.cli import parser

    def walk(p: argparse.ArgumentParser, path: str) -> list[str]:
        bare = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    bare += walk(sub, f"{path} {name}")
            elif isinstance(action, argparse._HelpAction):
                continue
            elif not action.help:
                bare.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
            elif action.option_strings and action.default not in (None, False) and \
                    "default" not in (action.help or ""):
                bare.append(f"{path} {action.option_strings[0]} (no default shown)")
        return bare

    assert walk(parser(), "gateway") == []
    assert parser().format_help().count("\n  gateway ") >= 3  # examples in the top help


def test_diff_names_billing_rule_changes() -> None:
    old = admin.validated({"teams": {"t": {}}})
    new = admin.validated({"billing": {"cancelled": "none"},
                            "teams": {"t": {"billing": {"cancelled": "delivered"}}}})
    assert admin.diff(old, new).lines() == ["  ~ teams.t", "  + billing.cancelled"]
    assert admin.diff(new, new).empty


def test_diff_of_a_pass_through_path_listed_twice_is_what_requests_get() -> None:
    """The routes allow a path listed twice by either entry's methods: the diff said "no
    change" when a second entry opened GET on a POST-only path (the first one's dropped)."""
    old = admin.validated({"passthrough": [{"path": "/tokenize", "methods": ["POST"]}]})
    new = admin.validated({"passthrough": [{"path": "/tokenize", "methods": ["GET"]},
                                            {"path": "/tokenize", "methods": ["POST"]}]})
    assert admin.diff(old, new).lines() == ["  ~ passthrough./tokenize"]
    same = admin.validated({"passthrough": [{"path": "/tokenize", "methods": ["POST"]},
                                             {"path": "/tokenize", "methods": ["POST"]}]})
    assert admin.diff(old, same).empty


def test_the_key_commands_say_what_they_did(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    path = tmp_path / "policy.yaml"
    path.write_bytes(VALID)
    flags = ["--policy-file", str(path)]
    assert main(["keys", "revoke", "key_7Hq2", *flags]) == 0
    assert capsys.readouterr().out == "revoked key_7Hq2 in revision 1\n"
    assert main(["keys", "revoke", "key_7Hq2", *flags]) == 0
    assert capsys.readouterr().out == \
        "key_7Hq2 is already revoked: nothing changed (revision 1)\n"
    assert main(["keys", "enable", "key_7Hq2", *flags]) == 0
    assert capsys.readouterr().out == "re-enabled key_7Hq2 in revision 2\n"
    assert main(["keys", "update", "key_7Hq2", "--rps", "none", "--tokens-per-minute", "900",
                 "--models", "team", "--no-expiry", *flags]) == 0
    key = parse_doc(path.read_bytes()).keys["key_7Hq2"]
    assert (key.limits.rps, key.limits.tokens_per_minute, key.models, key.expires_at) == (
        None, 900, None, None)
    capsys.readouterr()
    assert main(["keys", "update", "key_7Hq2", "--models", "gpt-9", *flags]) == 2
    assert "keys.key_7Hq2.models.0: model 'gpt-9' matches no model" in capsys.readouterr().err
    assert main(["keys", "update", "key_7Hq2", "--concurrency", "1.5", *flags]) == 2
    assert main(["keys", "update", "key_7Hq2", *flags]) == 2  # nothing to update
    assert main(["keys", "revoke", "key_nope", *flags]) == 2
    assert main(["keys", "create", "--team", "team-a", "--models", "qwen3", *flags]) == 2
    assert "models.0: model 'qwen3' matches no model" in capsys.readouterr().err


@pytest.mark.parametrize("command", [("policy", "status"), ("policy", "show"),
                                     ("keys", "list"), ("keys", "show", "key_x")])
def test_commands_say_when_redis_does_not_answer(
        command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    """DESIGN §10 has `policy status` say how the spoke is doing: a Redis that does not
    answer is one error line and exit 1, not a traceback (the CLI's one boundary for it)."""
    assert cli(*command, "--redis-url", "redis://127.0.0.1:1/0") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "127.0.0.1:1" in err and "Traceback" not in err
