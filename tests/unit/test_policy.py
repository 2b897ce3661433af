"""Policy documents (DESIGN §2): validation with exact error paths, round trips, ACLs, tiers."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.errors import PolicyError
from gateway.policy.loader import dump_json, dump_yaml, load, parse_doc
from gateway.policy.model import LimitSpec, ModelAcl
from gateway.policy.schema import Limits

FIXTURES = Path(__file__).parent.parent / "fixtures" / "policies"
SECRET = "test"
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def problem_paths(err: PolicyError) -> list[str]:
    """'keys.key_7Hq2.limits.rps: Input should be ...' -> 'keys.key_7Hq2.limits.rps'."""
    return [p.split(": ", 1)[0] for p in err.problems]


# --- the valid document --------------------------------------------------------------------


def test_valid_fixture_loads_into_runtime_policy() -> None:
    policy = load(fixture("valid.yaml"), revision=4)

    assert policy.revision == 4
    key = policy.keys_by_digest[hashlib.sha256(SECRET.encode()).digest()]
    assert key.key_id == "key_7Hq2"
    assert key.team == "team-a"
    assert key.disabled is False
    assert key.expires_at == datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert key.limits == LimitSpec(rps=2.0, burst=2, concurrency=4, tokens_per_day=2_000_000)
    assert policy.models["qwen3-coder"] == LimitSpec(
        rps=50.0, burst=50, concurrency=128, tokens_per_minute=4_000_000)
    assert policy.teams["team-a"].tokens_per_day == 50_000_000
    assert policy.keys["key_7Hq2"] is key


def test_designs_own_example_loads_its_glob_ahead_of_any_model_a_warning() -> None:
    """DESIGN §2's example grants team-a "llama-*" with no llama model in `models`: a grant
    ahead of a family's first model is valid, and named as a warning (it may be a typo)."""
    doc = parse_doc(fixture("design_example.yaml"), source="design_example.yaml")
    policy = load(fixture("design_example.yaml"), revision=1)
    key = policy.keys["key_7Hq2"]
    assert key.may_use("qwen3-coder") and not key.team_acl.allows("mistral-7b")
    assert key.team_acl.allows("llama-3-70b")  # a llama model added later is granted
    assert doc.acl_warnings() == [
        "teams.team-a.models.1: glob 'llama-*' matches no model in `models` (qwen3-coder) yet"]


def test_a_glob_that_matches_no_model_is_a_warning_an_unknown_model_an_error() -> None:
    doc = parse_doc(fixture("acl_glob_matches_nothing.yaml"))
    assert doc.acl_warnings() == [
        "teams.team-a.models.1: glob 'mistral-*' matches no model in `models` "
        "(llama-3-8b, qwen3-coder) yet"]
    assert parse_doc(fixture("valid.yaml")).acl_warnings() == []
    with pytest.raises(PolicyError) as info:
        parse_doc(fixture("acl_glob_matches_nothing.yaml").replace(b'"mistral-*"',
                                                                    b'"mistral-7b"'))
    assert info.value.problems == [
        "teams.team-a.models.1: model 'mistral-7b' matches no model in `models` "
        "(llama-3-8b, qwen3-coder)"]


def test_revision_comes_from_document_unless_given() -> None:
    text = fixture("valid.yaml") + b"revision: 9\n"
    assert load(text).revision == 9
    assert load(text, revision=12).revision == 12
    assert load(fixture("valid.yaml")).revision == 0


def test_a_revision_past_redis_doubles_is_refused_naming_the_path() -> None:
    """`policy apply` stores a document's own revision through Redis's Lua, whose numbers
    are doubles: 1733456789012345678 (time.time_ns()) was stored as '1.73...e+18', and then
    no sidecar, syncer or `policy status` could read the revision back as an integer."""
    assert load(fixture("valid.yaml") + f"revision: {2**53 - 1}\n".encode()).revision == 2**53 - 1
    with pytest.raises(PolicyError, match="revision: Input should be less than or equal"):
        parse_doc(fixture("valid.yaml") + b"revision: 1733456789012345678\n")


def test_empty_document_is_an_empty_policy() -> None:
    doc = parse_doc("")
    assert doc.models == {} and doc.teams == {} and doc.keys == {}


# --- one fixture per error kind: the problem names the exact path ----------------------------

BAD = [
    ("bad_unknown_top_key.yaml", "tenants", "Extra inputs"),
    ("bad_limits_misspelled_key.yaml", "keys.key_7Hq2.limits.rsp", "Extra inputs"),
    ("bad_negative_rps.yaml", "keys.key_7Hq2.limits.rps", "greater than 0"),
    ("bad_burst_without_rps.yaml", "keys.key_7Hq2.limits", "burst is set but rps is not"),
    ("bad_sha256.yaml", "keys.key_7Hq2.sha256", "pattern"),
    ("bad_unknown_team.yaml", "keys.key_7Hq2.team", "unknown team 'team-b'"),
    ("bad_duplicate_sha256.yaml", "keys.key_copy.sha256", "same digest as keys.key_7Hq2"),
    ("bad_expires_at.yaml", "keys.key_7Hq2.expires_at", "datetime"),
    ("bad_not_mapping.yaml", "(document)", "must be a mapping"),
    ("bad_yaml_syntax.yaml", "(document)", "not valid YAML"),
    # pydantic marks a bad dict *key* with '[key]' after the offending key id
    ("bad_key_id.yaml", "keys.key-7Hq2!.[key]", "letters, digits or '_' (no '-'"),
    # an ACL entry naming a model `models` lacks would 403 every request meant for it
    ("bad_key_acl_names_unknown_model.yaml", "keys.key_7Hq2.models.1",
     "model 'qwen3-coderr' matches no model"),
]


@pytest.mark.parametrize(("name", "path", "words"), BAD, ids=[b[0] for b in BAD])
def test_invalid_fixture_names_the_path(name: str, path: str, words: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(fixture(name), source=name)

    err = info.value
    assert problem_paths(err) == [path], err.problems  # exactly one problem, at that path
    assert words in err.problems[0]
    assert err.source == name
    assert str(err).startswith(f"{name}: {path}")


def test_star_acl_is_valid_even_with_no_models() -> None:
    doc = parse_doc("teams: {t: {models: ['*']}}")
    assert doc.teams["t"].models == ["*"]


def test_acl_globs_match_case_sensitively_as_requests_do() -> None:
    doc = parse_doc("models: {Qwen3: {}}\nteams: {t: {models: ['qwen*']}}")
    assert [w.split(": ", 1)[0] for w in doc.acl_warnings()] == ["teams.t.models.0"]
    with pytest.raises(PolicyError) as info:
        parse_doc("models: {Qwen3: {}}\nteams: {t: {models: ['qwen3']}}")
    assert problem_paths(info.value) == ["teams.t.models.0"]


def test_every_bad_fixture_is_covered() -> None:
    on_disk = {p.name for p in FIXTURES.glob("bad_*.yaml")}
    covered = {b[0] for b in BAD} | {"bad_expires_at_impossible_date.yaml"}
    assert on_disk == covered



def test_impossible_yaml_timestamp_is_a_policy_error() -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(fixture("bad_expires_at_impossible_date.yaml"))
    assert problem_paths(info.value)[0] in ("keys.key_7Hq2.expires_at", "(document)")


def test_all_problems_are_reported_at_once() -> None:
    text = f"""
teams: {{t: {{limits: {{rps: 0}}}}}}
keys:
  k1: {{team: t, sha256: "{DIGEST}", limits: {{concurrency: -1}}}}
"""
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert sorted(problem_paths(info.value)) == ["keys.k1.limits.concurrency", "teams.t.limits.rps"]


@pytest.mark.parametrize("limits, path", [
    ("{tokens_per_day: 1e23}", "tokens_per_day"),  # was accepted, then refused by Redis
    ("{tokens_per_minute: 9007199254740992}", "tokens_per_minute"),  # 2**53: Lua rounds it
    ("{rps: .inf}", "rps"), ("{rps: 1, burst: 9007199254740993}", "burst")])
def test_a_limit_the_store_cannot_count_exactly_is_invalid(limits: str, path: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(f"teams: {{t: {{limits: {limits}}}}}")
    assert problem_paths(info.value) == [f"teams.t.limits.{path}"]
    doc = parse_doc("teams: {t: {limits: {tokens_per_day: 9007199254740991, rps: 1e6}}}")
    assert doc.teams["t"].limits.tokens_per_day == 2**53 - 1


@pytest.mark.parametrize("text, path", [
    ("teams: {t: {limits: {concurrency: yes}}}", "teams.t.limits.concurrency"),
    ("teams: {t: {limits: {rps: true, burst: 2}}}", "teams.t.limits.rps"),
    ("teams: {t: {limits: {rps: 2, burst: true}}}", "teams.t.limits.burst"),
    ("teams: {t: {global_limits: {tokens_per_day: on}}}", "teams.t.global_limits.tokens_per_day"),
    ("revision: true", "revision"),
    ("models: {m: {prices: [{effective: 2026-01-01T00:00:00Z, input: true, output: 1}]}}",
     "models.m.prices.0.input"),
])
def test_a_boolean_is_not_a_number(text: str, path: str) -> None:
    """YAML reads `yes`/`on`/`true` as a boolean, and pydantic would read that as 1: a
    `concurrency: yes` would have been a limit of one request. It is refused instead."""
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert problem_paths(info.value) == [path]
    assert "a number, not true" in str(info.value)


@pytest.mark.parametrize("char", ["\x01", "\x1f", "\x7f", "\x85", "\x9f"])
def test_a_name_with_a_control_character_is_refused(char: str) -> None:
    """contracts.md §2.1: names have no control characters (C0, DEL and C1 alike)."""
    data = {"models": {f"m{char}": {}}, "teams": {f"t{char}": {}}}
    with pytest.raises(PolicyError) as info:
        parse_doc(json.dumps(data))
    assert sorted(problem_paths(info.value)) == [f"models.m{char}.[key]", f"teams.t{char}.[key]"]
    assert list(parse_doc(json.dumps({"models": {"qwén-3~": {}}})).models) == ["qwén-3~"]


def test_expires_at_without_timezone_is_rejected() -> None:
    text = f"""
teams: {{t: {{}}}}
keys: {{k1: {{team: t, sha256: "{DIGEST}", expires_at: 2027-01-01T00:00:00}}}}
"""
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert problem_paths(info.value) == ["keys.k1.expires_at"]



def test_upper_case_sha256_is_normalised() -> None:
    text = f"""
teams: {{t: {{}}}}
keys: {{k1: {{team: t, sha256: "{DIGEST.upper()}"}}}}
"""
    assert parse_doc(text).keys["k1"].sha256 == DIGEST


# --- formats and round trips -------------------------------------------------------------------


def test_json_input_is_accepted_and_equals_the_yaml() -> None:
    data = yaml.safe_load(fixture("valid.yaml"))
    data["keys"]["key_7Hq2"]["expires_at"] = "2027-01-01T00:00:00Z"
    from_json = parse_doc(json.dumps(data).encode())
    assert from_json == parse_doc(fixture("valid.yaml"))


@pytest.mark.parametrize("dumps", [
    lambda d: json.dumps(d, indent="\t"),  # tab-indented (Go's MarshalIndent, jq --tab)
    lambda d: json.dumps(d, separators=(",", ":\t")),  # a tab between tokens
    lambda d: json.dumps(d),  # ASCII only: a non-BMP character as a \\ud83d\\ude80 pair
], ids=["tab-indent", "tab-between-tokens", "surrogate-pair-escape"])
def test_any_valid_json_is_read_as_json(dumps: Any) -> None:
    """YAML 1.1 (PyYAML) refuses tab whitespace and decodes an escaped surrogate pair as two
    lone surrogates: valid JSON, which DESIGN §2 accepts, must not be read as YAML."""
    data = {"models": {"qwen-🚀": {"limits": {"rps": 5}}},
            "teams": {"t": {"models": ["qwen-*"]}},
            "keys": {"k1": {"team": "t", "sha256": DIGEST,
                            "expires_at": "2027-01-01T00:00:00Z"}}}
    doc = parse_doc(dumps(data).encode())
    assert list(doc.models) == ["qwen-🚀"] and doc.models["qwen-🚀"].limits.rps == 5
    assert doc == parse_doc(json.dumps(data, ensure_ascii=False))


@pytest.mark.parametrize(("text", "problem"), [
    (b"models: {m\xff: {}}\n", "(document): not UTF-8 text: byte 0xff at line 1, byte "
     "offset 10 (invalid start byte): save the file as UTF-8"),
    (b"models: {}\nteams: {t\x07: {}}\n", "(document): character U+0007 at line 2 is a "
     "control character, which YAML does not allow: remove it"),
])
def test_a_file_that_is_not_text_says_which_byte_and_line(text: bytes, problem: str) -> None:
    """Was PyYAML's `unacceptable character #x00ff: invalid start byte in "<byte string>",
    position 10`: no line, and a name that is not the file's."""
    with pytest.raises(PolicyError) as info:
        parse_doc(text, "p.yaml")
    assert info.value.problems == [problem]


def test_a_yaml_syntax_error_names_the_file_not_a_byte_string() -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(b"models:\n\tm: {}\n", "p.yaml")
    assert 'in "p.yaml", line 2, column 1' in info.value.problems[0]
    assert "<byte string>" not in info.value.problems[0]


def test_json_input_errors_name_the_path() -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(json.dumps({"models": {"m": {"limits": {"rps": -1}}}}))
    assert problem_paths(info.value) == ["models.m.limits.rps"]


def test_dump_yaml_round_trips() -> None:
    doc = parse_doc(fixture("valid.yaml"))
    text = dump_yaml(doc)
    assert parse_doc(text) == doc
    assert "revision" not in yaml.safe_load(text)


def test_dump_yaml_with_revision_round_trips() -> None:
    doc = parse_doc(fixture("valid.yaml"))
    again = parse_doc(dump_yaml(doc, revision=7))
    assert again.revision == 7
    assert again.model_copy(update={"revision": None}) == doc


def test_dump_json_round_trips() -> None:
    doc = parse_doc(fixture("valid.yaml"))
    assert parse_doc(dump_json(doc)) == doc


def test_dump_is_minimal_and_keeps_meaningful_empties() -> None:
    text = f"""
teams: {{t: {{}}}}
keys: {{k1: {{team: t, sha256: "{DIGEST}", models: []}}}}
"""
    doc = parse_doc(text)
    data = yaml.safe_load(dump_yaml(doc))
    # defaults (disabled: false, empty limits) are left out; models: [] (no model) is kept
    assert data["keys"]["k1"] == {"team": "t", "sha256": DIGEST, "models": []}
    assert parse_doc(dump_yaml(doc)) == doc


# --- model ACLs --------------------------------------------------------------------------------


@pytest.mark.parametrize(("patterns", "model", "allowed"), [
    (["llama-*"], "llama-3.1-8b", True),
    (["llama-*"], "llama-", True),
    (["llama-*"], "llama", False),
    (["llama-*"], "my-llama-3", False),  # a glob matches the whole name, not a substring
    (["llama-*"], "Llama-3", False),  # model names are case-sensitive, as the models section
    (["*"], "anything/at-all:v2", True),
    (["qwen3-coder"], "qwen3-coder", True),
    (["qwen3-coder"], "qwen3-coder-v2", False),
    (["qwen3-coder"], "qwen3-code", False),
    (["qwen3.coder"], "qwen3-coder", False),  # '.' is literal, not a regex wildcard
    (["qwen3-coder", "llama-*"], "llama-3", True),
    (["qwen3-coder", "llama-*"], "mistral", False),
    ([], "qwen3-coder", False),
])
def test_model_acl_globs(patterns: list[str], model: str, allowed: bool) -> None:
    acl = ModelAcl(patterns)
    assert acl.allows(model) is allowed
    assert acl.allows(model) is allowed  # the cached answer is the same


ACL_POLICY = f"""
models: {{qwen3-coder: {{}}, llama-3: {{}}}}
teams:
  team-a: {{models: ["llama-*"]}}
keys:
  narrow: {{team: team-a, sha256: "{DIGEST}", models: ["qwen3-coder"]}}
  inherit: {{team: team-a, sha256: "{"1" * 64}"}}
  nothing: {{team: team-a, sha256: "{"2" * 64}", models: []}}
"""


def test_key_acl_narrows_never_widens() -> None:
    policy = load(ACL_POLICY)
    narrow = policy.keys["narrow"]
    # the key lists qwen3-coder, but the team does not allow it: denied
    assert narrow.may_use("qwen3-coder") is False
    # the team allows llama-*, but the key narrowed to qwen3-coder only: denied
    assert narrow.may_use("llama-3") is False


def test_key_without_models_inherits_team_acl() -> None:
    policy = load(ACL_POLICY)
    assert policy.keys["inherit"].may_use("llama-3") is True
    assert policy.keys["inherit"].may_use("qwen3-coder") is False
    assert policy.keys["nothing"].may_use("llama-3") is False


# --- tiers and limits ----------------------------------------------------------------------------


def test_tiers_for_lists_only_tiers_with_limits_in_order() -> None:
    text = f"""
models:
  limited: {{limits: {{concurrency: 3}}}}
  free: {{}}
teams:
  t: {{models: ["*"], limits: {{tokens_per_day: 100}}}}
  bare: {{models: ["*"]}}
keys:
  k: {{team: t, sha256: "{DIGEST}", limits: {{rps: 1}}}}
  b: {{team: bare, sha256: "{"1" * 64}"}}
"""
    policy = load(text)
    k, b = policy.keys["k"], policy.keys["b"]

    tiers = policy.tiers_for("limited", k)
    assert [(t.tier, t.name) for t in tiers] == [("model", "limited"), ("team", "t"), ("key", "k")]
    assert tiers[0].spec.concurrency == 3
    assert tiers[1].spec.tokens_per_day == 100
    assert tiers[2].spec.rps == 1.0

    assert [t.tier for t in policy.tiers_for("free", k)] == ["team", "key"]
    assert [t.tier for t in policy.tiers_for(None, k)] == ["team", "key"]
    assert [t.tier for t in policy.tiers_for("unknown", k)] == ["team", "key"]
    assert [t.tier for t in policy.tiers_for("limited", b)] == ["model"]
    assert policy.tiers_for("free", b) == ()


@pytest.mark.parametrize(("limits", "burst"), [
    ({"rps": 2}, 2),
    ({"rps": 2.5}, 3),
    ({"rps": 0.1}, 1),  # never below one request
    ({"rps": 10, "burst": 25}, 25),
    ({"rps": 10, "burst": 1}, 1),
    ({}, None),
    ({"concurrency": 4}, None),
])
def test_effective_burst(limits: dict[str, float], burst: int | None) -> None:
    parsed = Limits.model_validate(limits)
    assert parsed.effective_burst == burst
    assert LimitSpec.of(parsed).burst == burst


def test_limit_spec_emptiness() -> None:
    assert LimitSpec().empty
    assert not LimitSpec(concurrency=0).empty  # zero is a limit, not "unlimited"
    assert not LimitSpec(tokens_per_month=5).empty
    assert LimitSpec(tokens_per_minute=1).has_tokens
    assert not LimitSpec(rps=1.0, burst=1, concurrency=1).has_tokens


# --- billing rules for client-cancelled streams -------------------------------------------------


def _billing_doc(platform: str | None, team_a: str | None) -> str:
    top = f"billing: {{cancelled: {platform}}}\n" if platform else ""
    team = f", billing: {{cancelled: {team_a}}}" if team_a else ""
    return f"""{top}
teams: {{team-a: {{models: ["*"]{team}}}, team-b: {{}}}}
keys:
  ka: {{team: team-a, sha256: "{DIGEST}"}}
  kb: {{team: team-b, sha256: "{'0' * 64}"}}
"""


@pytest.mark.parametrize(("platform", "team_a", "rule_a", "rule_b"), [
    (None, None, "generated", "generated"),  # the default: today's behaviour
    ("none", None, "none", "none"),  # a platform rule applies to every team
    (None, "delivered", "delivered", "generated"),  # a team's own overrides the default
    ("none", "generated", "generated", "none"),  # ... and the platform's
])
def test_the_cancel_rule_compiles_into_each_key(platform: str | None, team_a: str | None,
                                                rule_a: str, rule_b: str) -> None:
    policy = load(_billing_doc(platform, team_a))
    assert policy.keys["ka"].cancelled == rule_a
    assert policy.keys["kb"].cancelled == rule_b
    assert parse_doc(dump_yaml(policy.doc)) == policy.doc  # and survives show → apply


@pytest.mark.parametrize(("text", "path"), [
    ("billing: {cancelled: partial}", "billing.cancelled"),
    ("billing: {canceled: none}", "billing.canceled"),
    ("billing: none", "billing"),
    ("teams: {t: {billing: {cancelled: delivred}}}", "teams.t.billing.cancelled"),
    ("teams: {t: {billing: {completed: none}}}", "teams.t.billing.completed"),
])
def test_unknown_cancel_rules_and_keys_are_errors(text: str, path: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert problem_paths(info.value) == [path], info.value.problems


def test_global_limits_on_a_team_or_key_become_their_tiers_quotas() -> None:
    text = f"""
teams:
  t: {{models: ["*"], global_limits: {{tokens_per_day: 1000}}}}
keys:
  k: {{team: t, sha256: "{DIGEST}", limits: {{rps: 1}}, global_limits: {{tokens_per_month: 5}}}}
"""
    policy = load(text)
    team, key = policy.tiers_for(None, policy.keys["k"])
    assert (team.tier, team.spec.global_tokens_per_day, team.spec.tokens_per_day) == (
        "team", 1000, None)
    assert (key.spec.global_tokens_per_month, key.spec.rps) == (5, 1.0)
    assert dump_yaml(parse_doc(text)).count("global_limits") == 2  # round-trips


def test_bad_global_limits_name_the_path() -> None:
    text = f"""
teams: {{t: {{global_limits: {{tokens_per_day: -1}}}}}}
keys: {{k: {{team: t, sha256: "{DIGEST}", global_limits: {{tokens_per_minute: 5}}}}}}
"""
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert sorted(problem_paths(info.value)) == [
        "keys.k.global_limits.tokens_per_minute", "teams.t.global_limits.tokens_per_day"]


# --- a key given twice: refused, not the last one silently kept ------------------------------


@pytest.mark.parametrize(("text", "path", "key"), [
    # an rps written twice: YAML (and JSON) keep the last, with no word said
    ("models:\n  a:\n    limits: {rps: 1, rps: 100}\n", "models.a.limits", "rps"),
    # a second `limits:` under one team dropped the first one's rps: the team unlimited
    ("teams:\n  t:\n    limits: {rps: 10}\n    models: ['*']\n    limits: {concurrency: 5}\n",
     "teams.t", "limits"),
    # a section appended at the end replaced the whole first one
    ("models:\n  a: {}\nteams:\n  t: {}\nmodels:\n  b: {}\n", "(document)", "models"),
    ('{"models": {"a": {}, "a": {"limits": {"rps": 1}}}}', "models", "a"),
    ('{"teams": {"t": {"limits": {"rps": 10}, "limits": {"concurrency": 5}}}}',
     "teams.t", "limits"),
])
def test_a_key_given_twice_is_refused_naming_its_path(text: str, path: str, key: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert problem_paths(info.value) == [path], info.value.problems
    assert f"{key!r} given twice" in info.value.problems[0]


def test_merge_keys_may_override_what_they_merge() -> None:
    """`<<: *anchor` then a key of the anchor's is an override, as YAML means it."""
    doc = parse_doc("models:\n  a: {limits: &l {rps: 1, concurrency: 2}}\n"
                    "  b: {limits: {<<: *l, rps: 5}}\n")
    assert doc.models["b"].limits.rps == 5 and doc.models["b"].limits.concurrency == 2


@pytest.mark.parametrize(("text", "path", "words"), [
    # YAML 1.1 reads a leading 0 as octal: `concurrency: 010` was a limit of 8
    ("teams: {t: {limits: {concurrency: 010}}}", "teams.t.limits.concurrency", "octal"),
    ("teams: {t: {limits: {tokens_per_day: 0_100}}}", "teams.t.limits.tokens_per_day", "octal"),
    # ... and a colon as base 60: `tokens_per_day: 1:30` was 90
    ("teams: {t: {limits: {tokens_per_day: 1:30}}}", "teams.t.limits.tokens_per_day", "base 60"),
    ("teams: {t: {limits: {rps: 1:30.5}}}", "teams.t.limits.rps", "base 60"),
])
def test_a_yaml_1_1_number_that_means_another_is_refused(text: str, path: str,
                                                         words: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert problem_paths(info.value) == [path], info.value.problems
    assert words in info.value.problems[0] and "line 1" in info.value.problems[0]


@pytest.mark.parametrize(("text", "path", "key"), [
    ("models: {on: {}}", "models", "'on'"),  # YAML 1.1: True, which a name cannot be
    ("models: {m: {}}\nteams: {t: {models: [m]}}\nkeys: {No: {team: t, sha256: x}}", "keys",
     "'No'"),
    ("models: {~: {}}", "models", "'~'"),  # null
])
def test_a_name_yaml_1_1_reads_as_a_boolean_or_null_is_refused(text: str, path: str,
                                                             key: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    problem = next(p for p in info.value.problems if "YAML 1.1" in p)
    assert problem.startswith(f"{path}: key {key}") and "quote it" in problem, problem


def test_plain_and_explicit_numbers_still_read_as_written() -> None:
    doc = parse_doc("teams: {t: {limits: {concurrency: 0, tokens_per_day: 50_000_000, "
                    "tokens_per_minute: 0x10, rps: 0.5}}}")
    assert doc.teams["t"].limits == Limits(concurrency=0, tokens_per_day=50_000_000,
                                           tokens_per_minute=16, rps=0.5)
    assert parse_doc('{"teams": {"t": {"limits": {"concurrency": 10}}}}')  # JSON has no octal


@pytest.mark.parametrize("written", ["1e6", "'1e6'", '"1e+6"', "1.0e6", "1_000_000",
                                     "'1000000'", "1.0e+6"])
def test_a_number_yaml_1_1_reads_as_text_is_the_number_it_spells(written: str) -> None:
    """YAML 1.1 reads `1e6` (no dot, or no sign in its exponent) as text: pydantic read that
    as a float (`rps: 1e6`) but refused it as an integer ("unable to parse string as an
    integer"). Every numeric field reads it alike now, quoted or not."""
    doc = parse_doc(f"models:\n  m1: {{limits: {{rps: {written}}}}}\nteams:\n"
                    f"  t1: {{models: ['*'], limits: {{tokens_per_day: {written}}}}}\n")
    assert doc.teams["t1"].limits.tokens_per_day == 1_000_000
    assert doc.models["m1"].limits.rps == 1e6
    assert parse_doc('{"teams": {"t": {"limits": {"tokens_per_day": "1e6", "rps": 1e6}}}}'
                     ).teams["t"].limits == Limits(tokens_per_day=1_000_000, rps=1e6)


@pytest.mark.parametrize("field", ["tokens_per_day", "burst", "concurrency"])
def test_a_whole_number_past_any_count_is_refused_as_such(field: str) -> None:
    """`1e20` is read as a float (past an int64): pydantic said "Unable to parse input string
    as an integer, exceeded maximum size", which reads as a malformed number."""
    with pytest.raises(PolicyError) as err:
        parse_doc(f"teams: {{t: {{limits: {{{field}: 1e20}}}}}}")
    assert f"teams.t.limits.{field}: Value error, 1e20 is more than any count: at most " \
           f"9007199254740991" in str(err.value)
    assert "exceeded maximum size" not in str(err.value)
    assert parse_doc("teams: {t: {limits: {rps: 1e6}}}")  # a rate: as before


@pytest.mark.parametrize(("text", "problem"), [
    ("teams:\n  t1:\n    limits: {tokens_per_day: 10k}\n",
     "teams.t1.limits.tokens_per_day: 10k (line 3) is read by YAML as text, not a number: "
     "write 10000"),
    ("teams:\n  t1:\n    limits:\n      rps: 1.5M\n",
     "teams.t1.limits.rps: 1.5M (line 4) is read by YAML as text, not a number: write 1500000"),
    ("teams: {t: {global_limits: {tokens_per_month: '2B'}}}",
     "teams.t.global_limits.tokens_per_month: '2B' (line 1) is text, not a number: "
     "write 2000000000"),
    ("teams: {t: {limits: {concurrency: \"1,000\"}}}",
     "teams.t.limits.concurrency: \"1,000\" (line 1) is text, not a number: write 1000"),
    ("teams: {t: {limits: {rps: fast}}}",
     "teams.t.limits.rps: fast (line 1) is read by YAML as text, not a number"),
    ("models: {m: {prices: [{effective: 2026-01-01T00:00:00Z, input: 1, output: 2k}]}}",
     "models.m.prices.0.output: 2k (line 1) is read by YAML as text, not a number: "
     "write 2000"),
    ('{"teams": {"t": {"limits": {"tokens_per_day": "10k"}}}}',
     'teams.t.limits.tokens_per_day: "10k" is text, not a number: write 10000'),
])
def test_text_that_spells_no_number_is_refused_naming_its_line_and_the_fix(
        text: str, problem: str) -> None:
    """`tokens_per_day: 10k` was "Input should be a valid integer, unable to parse string as
    an integer": neither the value, nor its line, nor what to write."""
    with pytest.raises(PolicyError) as info:
        parse_doc(text)
    assert info.value.problems == [problem]


@pytest.mark.parametrize(("written", "problem"), [
    ("2.5", "is not a whole number"), ("-1e20", "is below 0"),
    ("1e20", "is more than any count: at most 9007199254740991")])
def test_a_count_is_refused_by_the_file_as_the_flags_refuse_it(written: str,
                                                               problem: str) -> None:
    """One rule (fields.not_a_count) for the policy file and the limit flags."""
    import argparse

    from gateway.key_commands import whole_limit
    with pytest.raises(PolicyError) as err:
        parse_doc(f"teams: {{t: {{limits: {{concurrency: {written}}}}}}}")
    assert f"teams.t.limits.concurrency: Value error, {written} {problem}" in str(err.value)
    with pytest.raises(argparse.ArgumentTypeError, match=f"^'{written}' {problem}$"):
        whole_limit(written)
