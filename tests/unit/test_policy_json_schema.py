"""`gateway policy schema` (docs/policy.schema.json) against the loader (gateway/policy/
loader.py parse_doc): every policy the repository ships passes both; what the loader refuses
for a reason of one field the schema refuses too; and the schema is never stricter than the
loader: a value the loader takes, it takes.

Known gaps, where the schema takes what the loader refuses (the schema's description says
them): everything that spans fields (a key's team, unique digests, an ACL entry naming a
model, `burst` without `rps`, two prices at one `effective`); a number written as text is
checked for its sign, zero and (without an exponent) a fraction, not against its range
(`"1e20"` as a count, `"2000"` as a weight, `"1.5e0"` as a count); an instant's day against
its month (`2026-02-30`), year 0, and a Unix time past 9999; YAML 1.1's own readings that an
editor's YAML 1.2 reads otherwise (`010`, `1:30`, a key `on`); Python's `re` `$` before a
final newline (jsonschema's, not an editor's). Where the schema is stricter: a number
spelled with non-ASCII digits or whitespace (`"١٢"`, which Decimal reads), tested below."""

from __future__ import annotations

import calendar
import hashlib
import json
import re
import string
import time
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import cli
from gateway.errors import PolicyError
from gateway.policy.fields import MAX_COUNT, read_number
from gateway.policy.json_schema import policy_json_schema, policy_json_schema_text
from gateway.policy.loader import parse_doc

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "policies"
SCHEMA = policy_json_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
DIGEST = hashlib.sha256(b"test").hexdigest()


class _EditorLoader(yaml.SafeLoader):
    """YAML as an editor's language server hands it to the schema: an unquoted instant is
    text (YAML 1.2 has no timestamp type), not a datetime."""


_EditorLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def schema_ok(data: Any) -> bool:
    return VALIDATOR.is_valid(data)


def loader_ok(data: Any) -> bool:
    """The loader's verdict on `data` as a JSON document (no YAML readings in the way)."""
    try:
        parse_doc(orjson.dumps(data), "t")
    except PolicyError:
        return False
    return True


def editor_data(text: str) -> Any:
    return yaml.load(text, Loader=_EditorLoader)  # a SafeLoader


# --- the committed file, the command, the schema's own shape


def test_committed_schema_is_the_command_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["policy", "schema"]) == 0
    out = capsys.readouterr().out
    assert out == policy_json_schema_text()
    assert (ROOT / "docs" / "policy.schema.json").read_text() == out, \
        "stale: run `gateway policy schema > docs/policy.schema.json`"


def test_schema_is_draft_2020_12_with_title_and_description() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "$id" not in SCHEMA and SCHEMA["title"] and "team must exist" in SCHEMA["description"]


def _walk(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node, *(n for v in node.values() for n in _walk(v))]
    if isinstance(node, list):
        return [n for v in node for n in _walk(v)]
    return []


def test_every_strict_model_forbids_unknown_fields_and_no_field_is_unconstrained() -> None:
    for name, model in SCHEMA["$defs"].items():
        assert model["additionalProperties"] is False, name
    assert SCHEMA["additionalProperties"] is False
    for node in _walk(SCHEMA):
        for name, prop in node.get("properties", {}).items():
            assert set(prop) - {"title", "default", "description"}, f"{name} accepts anything"
        assert "patternProperties" not in node  # a key not matching would go unchecked
        assert "format" not in node  # pydantic reads more than RFC 3339's date-time


# --- the policies the repository ships


def _yaml_blocks(doc: str) -> list[tuple[str, str]]:
    text = (ROOT / doc).read_text()
    return [(f"{doc}:{text[:m.start()].count(chr(10)) + 1}", m[1])
            for m in re.finditer(r"```yaml\n(.*?)```", text, re.S)]


SHIPPED = [(p.name, p.read_text()) for p in sorted(FIXTURES.glob("*.yaml"))
           if not p.name.startswith("bad_")]
SHIPPED += [("devspoke/demo_policy.yaml", (ROOT / "devspoke" / "demo_policy.yaml").read_text())]
BLOCKS = [b for doc in ("README.md", "docs/contracts.md", "docs/policy.md")
          for b in _yaml_blocks(doc)]


@pytest.mark.parametrize(("name", "text"), SHIPPED, ids=[n for n, _ in SHIPPED])
def test_every_shipped_policy_passes_both(name: str, text: str) -> None:
    parse_doc(text, name)
    errors = [e.message for e in VALIDATOR.iter_errors(editor_data(text))]
    assert not errors, errors


@pytest.mark.parametrize(("where", "text"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_docs_yaml_blocks_schema_agrees_with_the_loader(where: str, text: str) -> None:
    """A whole document (README's, contracts' §2) passes both; a fragment (`sha256: "..."`)
    is refused by both or passes both."""
    try:
        parse_doc(text, where)
        loaded = True
    except PolicyError:
        loaded = False
    assert schema_ok(editor_data(text)) == loaded


def test_the_docs_whole_examples_are_among_them() -> None:
    whole = [w for w, text in BLOCKS if "keys:" in text and "previous:" in text]
    assert len(whole) == 2 and all(schema_ok(editor_data(dict(BLOCKS)[w])) for w in whole)


def test_testkit_policy_passes_both() -> None:
    from gateway.policy import secrets
    from testkit.spoke import KEY_LIMITS, policy_doc
    doc = policy_doc({k: secrets.new_secret(k) for k in KEY_LIMITS})
    assert loader_ok(doc) and schema_ok(doc)


# --- refused for one field's reason: by both; for a cross-field reason: by the loader only

FIELD_FIXTURES = ["bad_expires_at.yaml", "bad_expires_at_impossible_date.yaml",  # month 13
                  "bad_key_id.yaml", "bad_limits_misspelled_key.yaml", "bad_negative_rps.yaml",
                  "bad_not_mapping.yaml", "bad_sha256.yaml", "bad_unknown_top_key.yaml"]
CROSS_FIXTURES = ["bad_burst_without_rps.yaml", "bad_duplicate_sha256.yaml",
                  "bad_key_acl_names_unknown_model.yaml", "bad_unknown_team.yaml"]


def test_every_bad_fixture_is_classified() -> None:
    bad = {p.name for p in FIXTURES.glob("bad_*.yaml")} - {"bad_yaml_syntax.yaml"}
    assert bad == set(FIELD_FIXTURES) | set(CROSS_FIXTURES)


@pytest.mark.parametrize("name", FIELD_FIXTURES)
def test_bad_fixture_refused_by_both(name: str) -> None:
    text = (FIXTURES / name).read_text()
    with pytest.raises(PolicyError):
        parse_doc(text, name)
    assert not schema_ok(editor_data(text))


@pytest.mark.parametrize("name", CROSS_FIXTURES)
def test_cross_field_fixture_is_the_loaders_alone(name: str) -> None:
    text = (FIXTURES / name).read_text()
    with pytest.raises(PolicyError):
        parse_doc(text, name)
    assert schema_ok(editor_data(text))


def key(**fields: Any) -> dict[str, Any]:
    """A whole document with one model, team and key, the key's fields overridden."""
    return {"models": {"m": {}}, "teams": {"t": {"models": ["*"]}},
            "keys": {"k1": {"team": "t", "sha256": DIGEST, **fields}}}


def model(**fields: Any) -> dict[str, Any]:
    return {"models": {"m": fields}}


PRICE = {"effective": "2026-01-01T00:00:00Z", "input": 1, "output": 2}
REFUSED = {
    "unknown top field": {"modles": {}},
    "unknown key field": key(team_name="t"),
    "unknown limit": model(limits={"tokens_per_hour": 5}),
    "negative limit": model(limits={"concurrency": -1}),
    "negative limit as text": model(limits={"tokens_per_day": "-5"}),
    "fraction count": model(limits={"concurrency": 1.5}),
    "fraction count as text": model(limits={"concurrency": "1.5"}),
    "count past 2**53": model(limits={"tokens_per_day": MAX_COUNT + 1}),
    "rps 0": model(limits={"rps": 0}),
    "rps 0 as text": model(limits={"rps": "0e3"}),
    "burst 0": model(limits={"rps": 1, "burst": 0}),
    "10k": model(limits={"tokens_per_day": "10k"}),
    "1,000": model(limits={"tokens_per_day": "1,000"}),
    "nan text": model(limits={"rps": "nan"}),
    "limit true": model(limits={"concurrency": True}),
    "weight over 1000": model(token_weights={"output": 1001}),
    "negative price": model(prices=[{**PRICE, "input": -1}]),
    "price without output": model(prices=[{"effective": PRICE["effective"], "input": 1}]),
    "naive instant": model(prices=[{**PRICE, "effective": "2026-01-01T00:00:00"}]),
    "date only": key(expires_at="2027-01-01"),
    "bad digest": key(sha256="abc"),
    "bad digest char": key(sha256="g" * 64),
    "key id with dash": {"keys": {"key-1": {"team": "t", "sha256": DIGEST}}},
    "key id too long": {"keys": {"k" * 65: {"team": "t", "sha256": DIGEST}}},
    "empty model name": {"models": {"": {}}},
    "model name with control": {"models": {"a\x01b": {}}},
    "objective uppercase": key(inference_objective="Batch"),
    "objective underscore": key(inference_objective="batch_jobs"),
    "objective too long": key(inference_objective="a" * 254),
    "objective dot end": key(inference_objective="a."),
    "team not text": key(team=5),
    "models not a list": {"teams": {"t": {"models": "m"}}},
    "limits not a mapping": model(limits=[1]),
    "disabled 2": key(disabled=2),
    "disabled maybe": key(disabled="maybe"),
    "too many previous": key(previous=[{"sha256": DIGEST, "until": "2027-01-01T00:00:00Z"}] * 5),
    "unknown cancel rule": {"billing": {"cancelled": "all"}},
    "unknown method": {"passthrough": [{"path": "/x", "methods": ["TRACE"]}]},
    "no methods": {"passthrough": [{"path": "/x", "methods": []}]},
    "relative path": {"passthrough": [{"path": "x"}]},
    "dotted path": {"passthrough": [{"path": "/a/../b"}]},
    "escaped path": {"passthrough": [{"path": "/a%2Fb"}]},
    "path with query": {"passthrough": [{"path": "/a?b=1"}]},
    "revision 0": {"revision": 0},
    "document not a mapping": ["models"],
}


@pytest.mark.parametrize("doc", REFUSED.values(), ids=REFUSED.keys())
def test_field_level_refusal_is_the_schemas_too(doc: Any) -> None:
    assert not loader_ok(doc)
    assert not schema_ok(doc)


ACCEPTED = {  # what the loader reads besides the plain spelling: the schema must take it too
    "1e6 as text": model(limits={"tokens_per_day": "1e6"}),
    "1_000 as text": model(limits={"tokens_per_day": "1_000"}),
    "whole float count": model(limits={"concurrency": 4.0}),
    "-0 as text": model(limits={"concurrency": "-0"}),
    "rps text fraction": model(limits={"rps": " 0.5 "}),
    "revision as text": {"revision": "7"},
    "weight as text": model(token_weights={"output": "4"}),
    "instant with a space, no seconds": key(expires_at="2027-01-01 00:00+0100"),
    "instant lowercase": key(expires_at="2027-01-01t00:00:00.5z"),
    "instant as Unix time": key(expires_at=1800000000),
    "disabled yes": key(disabled="yes"),
    "disabled 1": key(disabled=1),
    "uppercase digest": key(sha256=DIGEST.upper()),
    "dotted objective": key(inference_objective="tier-1.batch"),
    "glob path": {"passthrough": [{"path": "/v1/files/*", "methods": ["GET", "DELETE"]}]},
    "empty document": {},
}


@pytest.mark.parametrize("doc", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_what_the_loader_reads_the_schema_takes(doc: Any) -> None:
    assert loader_ok(doc)
    assert schema_ok(doc)


# --- property tests: one field at a time, through a whole document

NUMBER_FIELDS = {  # field → the document around it
    "concurrency": lambda v: model(limits={"concurrency": v}),  # Count
    "burst": lambda v: model(limits={"rps": 1, "burst": v}),  # PositiveCount
    "rps": lambda v: model(limits={"rps": v}),  # Rate
    "price": lambda v: model(prices=[{**PRICE, "input": v}]),  # PerMillion
    "weight": lambda v: model(token_weights={"output": v}),  # Weight
}
NUMBER_TEXT = st.text(alphabet="0123456789._eE+- ", max_size=8) | st.sampled_from(
    ["1e6", "-0.0", "+.5", "5.", "1_000", "_1", "1e-3", "10e-1", "0e9", "1.5e1", "1e20", "inf"])
NUMBERS = (st.integers(-3, 2**54) | st.floats(allow_nan=False, allow_infinity=False)
           | st.booleans() | st.none() | NUMBER_TEXT)


def _reads(value: Any) -> bool:
    """Text the loader reads as a number (its range is then the loader's to check)."""
    try:
        return isinstance(value, str) and bool(read_number(value) is not None)
    except ValueError:
        return False


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(sorted(NUMBER_FIELDS)), value=NUMBERS)
def test_number_fields_schema_agrees_with_the_loader(field: str, value: Any) -> None:
    doc = NUMBER_FIELDS[field](value)
    loaded, checked = loader_ok(doc), schema_ok(doc)
    assert checked or not loaded, "the schema refuses what the loader reads"
    if checked and not loaded:  # text spelling a number out of the field's range
        assert _reads(value), value


def test_a_number_in_non_ascii_digits_is_where_the_schema_is_stricter() -> None:
    doc = model(limits={"concurrency": "١٢"})  # Decimal reads Arabic-Indic digits: 12
    assert loader_ok(doc) and not schema_ok(doc)


DATE_PIECES = st.tuples(
    st.sampled_from(["2026", "0000", "1999", "26"]), st.sampled_from(["-01", "-12", "-13", "-1"]),
    st.sampled_from(["-01", "-31", "-30", "-00", "-32"]), st.sampled_from(["T", "t", " ", "_", ""]),
    st.sampled_from(["00", "23", "24", "9"]), st.sampled_from([":00", ":59", ":60", ""]),
    st.sampled_from([":00", ":59", ":60", "", ":00.5", ":00,123456789", ":00."]),
    st.sampled_from(["Z", "z", "+01:00", "+0100", "-23:59", "+24:00", "+01", "", " Z", "UTC"]))
INSTANTS = st.builds(lambda p: "".join(p), DATE_PIECES) | st.integers(-10**12, 10**12) \
    | st.floats(-1e11, 1e11) | st.from_regex(r"\A[-+]?[0-9]{1,12}(\.[0-9]{1,3})?\Z")


def _past_the_month(text: str) -> bool:
    """Text the pattern cannot judge: a day its month lacks, year 0, beyond year 9999."""
    m = re.match(r"(\d{4})-(\d\d)-(\d\d)", text)
    if m is None:
        return True  # a Unix time as text: its range is pydantic's to check
    year, month, day = map(int, m.groups())
    if not 1 <= month <= 12:
        return False  # the pattern's to refuse
    return year == 0 or day > calendar.monthrange(max(year, 1), month)[1]


@settings(max_examples=400, deadline=None)
@given(value=INSTANTS)
def test_instants_schema_agrees_with_the_loader(value: Any) -> None:
    doc = key(expires_at=value)
    loaded, checked = loader_ok(doc), schema_ok(doc)
    assert checked or not loaded, "the schema refuses what the loader reads"
    if checked and not loaded:
        assert isinstance(value, (int, float)) or _past_the_month(value), value


TEXT_FIELDS = {
    "key id": lambda v: {"keys": {v: {"team": "t", "sha256": DIGEST}}, "teams": {"t": {}}},
    "model name": lambda v: {"models": {v: {}}},
    "objective": lambda v: {"teams": {"t": {"inference_objective": v}}},
    "digest": lambda v: key(sha256=v),
    "path": lambda v: {"passthrough": [{"path": v}]},
    "disabled": lambda v: key(disabled=v),
}
TEXTS = st.text(alphabet="aZ09_-./%2F?#\\\x01\x85 ", max_size=12) | st.sampled_from(
    ["a" * 64, "A" * 64, "a" * 253, "a" * 254, "yes", "Off", "T", "n", "", "/", "/a/", "/a/.",
     "/a/..", "/a/.b", "/%zz", "/%2f", "a..b", "a.-b"])


@settings(max_examples=600, deadline=None)
@given(field=st.sampled_from(sorted(TEXT_FIELDS)), value=TEXTS)
def test_text_fields_schema_agrees_with_the_loader(field: str, value: str) -> None:
    """Exact: each of these is a pattern the loader's own check also is."""
    doc = TEXT_FIELDS[field](value)
    assert schema_ok(doc) == loader_ok(doc), (field, value)


# --- whole documents: built without cross-field problems, the two verdicts are one

NAMES = st.text(alphabet=string.ascii_lowercase + "-._", min_size=1, max_size=6)
ANY_VALUE = NUMBERS | TEXTS | st.lists(st.integers(-5, 5), max_size=2)
LIMITS = st.dictionaries(st.sampled_from(["concurrency", "tokens_per_minute", "tokens_per_day",
                                          "tokens_per_month", "rps", "limit"]),
                         st.integers(-2, 2**54) | st.floats(-1, 1e17) | st.booleans(),
                         max_size=3)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    models = draw(st.dictionaries(NAMES, st.fixed_dictionaries({}, optional={
        "limits": LIMITS,
        "token_weights": st.dictionaries(st.sampled_from(["input", "output", "typo"]),
                                         st.floats(-1, 2000) | st.integers(-1, 2000),
                                         max_size=2)}), max_size=3))
    teams = draw(st.dictionaries(NAMES, st.fixed_dictionaries({"models": st.just(["*"])},
                                                              optional={"limits": LIMITS}),
                                 min_size=1, max_size=2))
    key_ids = draw(st.lists(st.from_regex(r"\A[a-zA-Z0-9_-]{1,6}\Z"), max_size=3, unique=True))
    keys = {}
    for i, kid in enumerate(key_ids):  # a distinct digest each: no cross-field problem
        entry: dict[str, Any] = {"team": draw(st.sampled_from(sorted(teams))),
                                 "sha256": hashlib.sha256(str(i).encode()).hexdigest()}
        if draw(st.booleans()):
            entry["limits"] = draw(LIMITS)
        if draw(st.booleans()):
            entry[draw(st.sampled_from(["disabled", "expires_at", "inference_objective",
                                        "team_id"]))] = draw(ANY_VALUE | INSTANTS)
        keys[kid] = entry
    return {"models": models, "teams": teams, "keys": keys}


@settings(max_examples=300, deadline=None)
@given(doc=documents())
def test_whole_documents_schema_agrees_with_the_loader(doc: dict[str, Any]) -> None:
    """`burst` is never drawn (it needs rps: cross-field), nor text numbers (their range),
    nor a day past its month's end; what remains, the two judge alike."""
    for entry in doc["keys"].values():
        if isinstance(when := entry.get("expires_at"), str) and _past_the_month(when):
            entry.pop("expires_at")
        if isinstance(entry.get("expires_at"), (int, float)):
            entry.pop("expires_at")  # a Unix time past 9999: pydantic's range
    assert schema_ok(doc) == loader_ok(doc), json.dumps(doc)[:400]


def _patterns(node: Any) -> set[str]:
    if isinstance(node, dict):
        return {v for k, v in node.items() if k == "pattern" and isinstance(v, str)} | {
            p for k, v in node.items() if k != "pattern" for p in _patterns(v)}
    if isinstance(node, list):
        return {p for v in node for p in _patterns(v)}
    return set()


# Runs a pattern could split more than one way, each followed by what fails it at the end.
_ADVERSARIAL = [pre + unit * (20_000 // len(unit)) + end
                for unit in ("_", " ", "1_", "0_", "a-", "/a", "._")
                for pre in ("", "1e", "-", " ")
                for end in ("x", "")]


@pytest.mark.parametrize("pattern", sorted(_patterns(SCHEMA)))
def test_no_pattern_backtracks_for_long_input(pattern: str) -> None:
    """An editor or CI validates whatever is in the file: every pattern answers a 20 kB value
    in linear time (`_*\\+?_*`, two stars either side of an optional sign, tried every split
    of a run of '_': ~20 s in Python's re for 20 kB, the number fields' text patterns)."""
    rx = re.compile(pattern)
    for text in _ADVERSARIAL:
        started = time.perf_counter()
        rx.search(text)
        took = time.perf_counter() - started
        assert took < 0.5, (pattern[:60], text[:8], len(text), f"{took:.2f} s")
