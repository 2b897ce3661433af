"""`inference_objective` on a team and a key (the Gateway API Inference Extension's
InferenceObjective): validated as a Kubernetes object name, the key's winning over its
team's, compiled into KeyRecord; the key commands set it and `keys show` says whose it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import keys_show
from gateway.cli import main
from gateway.errors import PolicyError
from gateway.policy.loader import dump_yaml, load, parse_doc
from gateway.policy.model import Policy

DIGESTS = {k: c * 64 for k, c in (("own", "a"), ("inherits", "b"), ("plain", "c"))}


def doc(team_objective: str | None = "batch", key_objective: str | None = "interactive"
        ) -> dict[str, Any]:
    teams: dict[str, Any] = {"t": {"models": ["*"]}, "u": {"models": ["*"]}}
    if team_objective is not None:
        teams["t"]["inference_objective"] = team_objective
    own: dict[str, Any] = {"team": "t", "sha256": DIGESTS["own"]}
    if key_objective is not None:
        own["inference_objective"] = key_objective
    return {"models": {"m": {}}, "teams": teams, "keys": {
        "own": own, "inherits": {"team": "t", "sha256": DIGESTS["inherits"]},
        "plain": {"team": "u", "sha256": DIGESTS["plain"]}}}


def compiled(d: dict[str, Any]) -> Policy:
    return load(json.dumps(d), revision=1)


def test_the_keys_objective_wins_over_its_teams() -> None:
    p = compiled(doc())
    assert {k: r.inference_objective for k, r in p.keys.items()} == {
        "own": "interactive", "inherits": "batch", "plain": ""}
    # a previous secret's record is the same key: the same objective
    assert {r.inference_objective for r in p.keys_by_digest.values()} == {
        "interactive", "batch", ""}


def test_no_objective_anywhere_compiles_to_none() -> None:
    p = compiled(doc(None, None))
    assert {r.inference_objective for r in p.keys.values()} == {""}


@pytest.mark.parametrize("name", ["a", "batch", "premium-tier", "gie.tier-1", "0", "a" * 253,
                                  ".".join(["abc"] * 63)])
def test_a_kubernetes_object_name_is_accepted(name: str) -> None:
    assert compiled(doc(name, name)).keys["own"].inference_objective == name


@pytest.mark.parametrize("name", ["Batch", "-batch", "batch-", "a..b", "a.-b", "a_b", "a b",
                                  "", "batch\n", "é", "a" * 254, ".a", "a."])
@pytest.mark.parametrize("where", ["teams.t", "keys.own"])
def test_a_name_kubernetes_refuses_is_refused_naming_the_path(name: str, where: str) -> None:
    d = doc()
    section, entry = where.split(".")
    d[section][entry]["inference_objective"] = name
    with pytest.raises(PolicyError) as info:
        parse_doc(json.dumps(d))
    [problem] = info.value.problems
    assert problem.startswith(f"{where}.inference_objective: ")
    assert "Kubernetes object name" in problem


def test_a_number_is_not_a_name() -> None:
    with pytest.raises(PolicyError) as info:
        parse_doc(b"teams: {t: {inference_objective: 1}}\n")
    assert info.value.problems[0].startswith("teams.t.inference_objective: ")


def test_the_objective_round_trips_through_a_dump() -> None:
    d = parse_doc(json.dumps(doc()))
    assert parse_doc(dump_yaml(d)) == d
    assert "inference_objective" not in dump_yaml(parse_doc(json.dumps(doc(None, None))))


# --- the key commands ----------------------------------------------------------------------


def _file(tmp_path: Path) -> list[str]:
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(doc(key_objective=None)))
    return ["--policy-file", str(path)]


def _key(flags: list[str], key_id: str) -> Any:
    return parse_doc(Path(flags[1]).read_bytes()).keys[key_id]


def test_keys_create_and_update_set_and_drop_the_objective(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = _file(tmp_path)
    assert main(["keys", "create", "--team", "t", "--key-id", "k1",
                 "--inference-objective", "premium", *flags]) == 0
    assert _key(flags, "k1").inference_objective == "premium"
    assert main(["keys", "update", "plain", "--inference-objective", "batch.low", *flags]) == 0
    assert _key(flags, "plain").inference_objective == "batch.low"
    assert main(["keys", "update", "k1", "--no-inference-objective", *flags]) == 0
    assert _key(flags, "k1").inference_objective is None
    capsys.readouterr()
    assert main(["keys", "update", "k1", "--no-inference-objective", *flags]) == 0
    assert "nothing changed" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["keys", "create", "--team", "t", "--inference-objective", "Premium"],
    ["keys", "update", "plain", "--inference-objective", "a_b"],
    ["keys", "update", "plain", "--inference-objective", "x", "--no-inference-objective"],
])
def test_a_bad_objective_flag_is_refused_and_publishes_nothing(
        tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    flags = _file(tmp_path)
    before = Path(flags[1]).read_bytes()
    with pytest.raises(SystemExit) as exit_:
        main([*argv, *flags])
    assert exit_.value.code == 2
    assert "--inference-objective" in capsys.readouterr().err
    assert Path(flags[1]).read_bytes() == before


def test_keys_show_says_the_objective_and_whose_it_is() -> None:
    p = compiled(doc())
    shown = {k: keys_show.as_data(p, k, [], 0.0, counters=False)
             for k in ("own", "inherits", "plain")}
    assert [(d["inference_objective"], d["inference_objective_from"])
            for d in shown.values()] == [("interactive", "key"), ("batch", "team"),
                                          (None, None)]
    orjson.dumps(shown)  # the -o json form
    lines = {k: keys_show.table(d).splitlines()[2] for k, d in shown.items()}
    assert lines == {"own": "inference objective: interactive (the key's own)",
                     "inherits": "inference objective: batch (team t's)",
                     "plain": "inference objective: none (x-gateway-inference-objective "
                              "not sent)"}


def test_keys_show_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = _file(tmp_path)
    assert main(["keys", "show", "inherits", *flags]) == 0
    assert "inference objective: batch (team t's)" in capsys.readouterr().out
    assert main(["keys", "show", "inherits", "-o", "json", *flags]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert (data["inference_objective"], data["inference_objective_from"]) == ("batch", "team")


def test_keys_list_says_the_objective_that_applies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`keys list` had no objective: the one that applies (the key's own, else its team's;
    `-` in the table, "" in the JSON, as its other empty fields, when neither names one)."""
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(doc()))
    flags = ["--policy-file", str(path)]
    assert main(["keys", "list", *flags]) == 0
    head, *rows = capsys.readouterr().out.splitlines()
    assert head.split()[-2:] == ["OBJECTIVE", "MODELS"]
    at = head.index("OBJECTIVE")
    assert {r.split()[0]: r[at:].split()[0] for r in rows} == {
        "own": "interactive", "inherits": "batch", "plain": "-"}
    assert main(["keys", "list", "-o", "json", *flags]) == 0
    listed = {r["key_id"]: (r["inference_objective"], r["inference_objective_from"])
              for r in orjson.loads(capsys.readouterr().out)}
    assert listed == {"own": ("interactive", "key"), "inherits": ("batch", "team"),
                      "plain": (None, None)}  # null, as keys show says it
