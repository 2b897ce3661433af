"""`gateway policy check FILE...`: the offline validation a CI job or a hub's tooling runs
before `policy apply` / `hub publish`: the loader's own checks (each field, and what spans
fields), no store, one line a valid file, every problem of an invalid one, exit 2."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from gateway.cli import main

POLICIES = Path(__file__).parent.parent / "fixtures" / "policies"
BAD = sorted(POLICIES.glob("bad_*.yaml"))


def test_a_valid_document_is_one_line_and_exit_0(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GATEWAY_REDIS_URL", "GATEWAY_POLICY_FILE"):  # no store is read
        monkeypatch.setenv(var, "redis://127.0.0.1:1/0" if "REDIS" in var else "/nonexistent")
    path = POLICIES / "valid.yaml"
    assert main(["policy", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{path}: valid (") and out.count("\n") == 1
    assert err == ""


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_every_refused_fixture_is_invalid_with_its_problem(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    head, *problems = err.splitlines()
    assert head == f"{path}: invalid:" and problems and all(p.startswith("  ") for p in problems)


def test_cross_field_problems_are_found_too(capsys: pytest.CaptureFixture[str]) -> None:
    """What no JSON Schema can say (docs/policy.schema.json): the loader's alone."""
    assert main(["policy", "check", str(POLICIES / "bad_duplicate_sha256.yaml")]) == 2
    assert "same digest as" in capsys.readouterr().err


def test_warnings_go_to_stderr_and_the_file_is_still_valid(
        capsys: pytest.CaptureFixture[str]) -> None:
    path = POLICIES / "acl_glob_matches_nothing.yaml"
    assert main(["policy", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{path}: valid")
    assert err.startswith(f"warning: {path}: ") and "matches no model" in err


def test_many_files_each_said_and_one_bad_one_fails_the_run(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good, bad = POLICIES / "valid.yaml", POLICIES / "bad_negative_rps.yaml"
    missing = tmp_path / "absent.yaml"
    assert main(["policy", "check", str(good), str(bad), str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}: valid")
    assert f"{bad}: invalid:" in err and f"{missing}: cannot read" in err


def test_stdin(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"models: {m: {}}\n")))
    assert main(["policy", "check", "-"]) == 0
    assert capsys.readouterr().out == "-: valid (1 model, 0 teams, 0 keys)\n"


@pytest.mark.parametrize("text", ["a: " + "[" * 5000 + "]" * 5000 + "\n",
                                  '{"models": ' + "[" * 5000 + "]" * 5000 + "}"],
                         ids=["yaml", "json"])
def test_a_document_nested_too_deeply_is_invalid_not_a_crash(
        text: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """PyYAML composes recursively (orjson refuses past 1024 levels and hands it over): a
    deep file was a RecursionError traceback, exit 1, and the files after it unchecked."""
    deep, good = tmp_path / "deep.yaml", POLICIES / "valid.yaml"
    deep.write_text(text)
    assert main(["policy", "check", str(deep), str(good)]) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}: valid")
    head, *problems = err.splitlines()
    assert head == f"{deep}: invalid:" and problems == ["  (document): nested too deeply"]


def test_a_document_with_no_models_is_valid_but_said(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Valid, but `policy apply` and `hub publish` refuse it without --allow-empty."""
    path = tmp_path / "empty.yaml"
    path.write_text("{}\n")
    assert main(["policy", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: valid (0 models, 0 teams, 0 keys)\n"
    assert err.startswith(f"warning: {path}: no models:") and "--allow-empty" in err
