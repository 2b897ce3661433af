"""The operator commands, given bad input or a dependency that is away: one `error:` line
naming what is wrong (the path, the flag, the setting), a non-zero exit, no traceback, and
nothing half-done. Found by running each command as an operator would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.policy.loader import parse_doc

FIXTURES = Path(__file__).parent.parent / "fixtures" / "policies"
VALID = (FIXTURES / "valid.yaml").read_bytes()
ROOT = Path(__file__).parent.parent.parent
CLOSED = "127.0.0.1:1"  # nothing listens there


def gateway_proc(*argv: str, **kw: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "gateway", *argv], env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, **kw)  # type: ignore[call-overload]


@pytest.mark.parametrize("command", [
    ["usage", "tail"],
    ["usage", "consume", "--until-caught-up", "--db", "sqlite:///{tmp}/u.db"],
])
def test_usage_commands_say_when_kafka_does_not_answer(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: aiokafka's KafkaConnectionError came out as a traceback."""
    argv = [a.format(tmp=tmp_path) for a in command]
    assert main([*argv, "--kafka", CLOSED]) == 1
    err = capsys.readouterr().err
    assert f"error: kafka {CLOSED}: " in err and "GATEWAY_KAFKA_BOOTSTRAP" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [
    ["usage", "consume", "--kafka", CLOSED, "--until-caught-up"],
    ["usage", "report"],
    ["usage", "reconcile", "--spool-dir", "."],
])
def test_a_db_that_is_not_a_database_url_is_refused_and_no_file_is_made(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `--db nonsense` (or mysql://x) made a SQLite file of that name here, and a
    path SQLite cannot open was a traceback."""
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--db", "nonsense"]) == 2
    assert "error: --db nonsense: not sqlite:///FILE or postgresql://" in \
        capsys.readouterr().err
    (tmp_path / "adir").mkdir()
    assert main([*command, "--db", f"sqlite:///{tmp_path}/adir"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --db sqlite:///{tmp_path}/adir: ") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


@pytest.mark.parametrize("command", [["usage", "report"],
                                     ["usage", "reconcile", "--spool-dir", "."]])
def test_reading_a_database_that_is_not_there_creates_none(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path}/typo.db"
    assert main([*command, "--db", url]) == 2
    assert f"error: --db {url}: no such database file" in capsys.readouterr().err
    assert not (tmp_path / "typo.db").exists()


def test_a_postgresql_db_without_psycopg_names_the_extra_that_installs_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A plain `pip install .` has no psycopg (it is the `postgres` extra): before, the
    operator read only `cannot open: No module named 'psycopg'`."""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg: ImportError
    assert main(["usage", "report", "--db", "postgresql://u:pw@127.0.0.1:1/billing"]) == 2
    err = capsys.readouterr().err
    assert "error: --db postgresql://127.0.0.1:1/billing: " in err, err
    assert "pip install 'gateway[postgres]'" in err and "pw" not in err, err


def test_consume_refuses_a_negative_count(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --count -1 stopped at once, exit 0, having read nothing."""
    assert main(["usage", "consume", "--kafka", CLOSED, "--count", "-1"]) == 2
    assert "error: --count -1" in capsys.readouterr().err


def test_a_stored_policy_file_that_cannot_be_read_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --policy-file naming a directory, or a file that is not YAML, was a
    traceback from policy show, keys list, keys show, policy status."""
    bad = tmp_path / "notyaml.yaml"
    bad.write_text("a: [\n")
    for path, why in ((tmp_path, "cannot read: Is a directory"), (bad, "not valid YAML")):
        for command in (["policy", "show"], ["keys", "list"], ["keys", "show", "k"],
                        ["policy", "status"]):
            assert main([*command, "--policy-file", str(path)]) == 1
            err = capsys.readouterr().err
            assert err.startswith(f"error: {path}: ") and why in err, err


def test_serve_reads_a_policy_path_that_is_a_directory_as_unreadable(tmp_path: Path) -> None:
    """Before: IsADirectoryError ended `gateway serve --policy-file DIR` at start."""
    from gateway.policy.holder import FilePolicySync, PolicyHolder
    sync = FilePolicySync(PolicyHolder(), tmp_path)
    sync.refresh()  # logged as policy_file_unreadable, as a file that is not there
    assert sync.holder.get() is None


@pytest.mark.parametrize("argv", [
    ["keys", "create", "--team", "team-a", "--rps", "nan"],
    ["keys", "create", "--team", "team-a", "--rps", "inf"],
    ["keys", "update", "key_7Hq2", "--rps", "nan"],
    ["keys", "update", "key_7Hq2", "--rps", "inf"],
])
def test_a_limit_that_is_not_a_finite_number_is_refused(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: nan and inf were written as null, i.e. the key got no rps limit at all,
    exit 0 (`keys update --rps nan` removed the one it had)."""
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(VALID)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--policy-file", str(policy)])
    assert exc.value.code == 2
    assert "argument --rps: " in capsys.readouterr().err
    assert policy.read_bytes() == VALID  # nothing published


@pytest.mark.parametrize("argv, limit, value", [
    (["keys", "create", "--team", "team-a", "--tokens-per-day", "1e6"], "tokens_per_day", 10**6),
    (["keys", "create", "--team", "team-a", "--tokens-per-minute", "2.5e4"],
     "tokens_per_minute", 25000),
    (["keys", "create", "--team", "team-a", "--concurrency", "1E1"], "concurrency", 10),
    (["keys", "create", "--team", "team-a", "--rps", "1e1"], "rps", 10),
    (["keys", "update", "key_7Hq2", "--tokens-per-month", "3e9"], "tokens_per_month", 3 * 10**9),
    (["keys", "update", "key_7Hq2", "--burst", "1e2", "--rps", "5"], "burst", 100),
])
def test_a_limit_flag_takes_the_spellings_the_policy_takes(
        argv: list[str], limit: str, value: int, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `keys create --tokens-per-day 1e6` was refused by argparse ("invalid int
    value: '1e6'"), though `tokens_per_day: 1e6` in a policy file is 1000000."""
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(VALID)
    assert main([*argv, "--policy-file", str(policy)]) == 0, capsys.readouterr().err
    doc = parse_doc(policy.read_bytes())
    key = next(k for k_id, k in doc.keys.items() if k_id != "key_7Hq2") \
        if argv[1] == "create" else doc.keys["key_7Hq2"]
    assert getattr(key.limits, limit) == value


@pytest.mark.parametrize("command", [["keys", "create", "--team", "team-a"],
                                     ["keys", "update", "key_7Hq2"]])
@pytest.mark.parametrize("flag", ["--rps", "--concurrency", "--tokens-per-minute",
                                  "--tokens-per-day"])
@pytest.mark.parametrize("text, fix", [("10k", "10000"), ("1,000", "1000"),
                                       ("1.5M", "1500000"), ("ten", "")])
def test_a_limit_flag_that_spells_no_number_is_refused_naming_it(
        command: list[str], flag: str, text: str, fix: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As `policy apply` refuses `rps: 10k`: the value as written, and the number it likely
    means. Before: `invalid int value: '10k'` (create), or no fix (create --rps, update)."""
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(VALID)
    with pytest.raises(SystemExit) as exc:
        main([*command, flag, text, "--policy-file", str(policy)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    said = f"argument {flag}: {text!r} is not a number"
    assert said in err and (f"{said} or `none`" in err) == (command[1] == "update"), err
    assert err.rstrip().endswith(f": write {fix}" if fix else "not a number or `none`"
                                 if command[1] == "update" else "not a number"), err
    assert policy.read_bytes() == VALID  # nothing published


@pytest.mark.parametrize("flag", ["--concurrency", "--tokens-per-minute", "--tokens-per-day"])
def test_keys_create_refuses_a_count_that_is_not_whole(
        flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(VALID)
    with pytest.raises(SystemExit) as exc:
        main(["keys", "create", "--team", "team-a", flag, "2.5", "--policy-file", str(policy)])
    assert exc.value.code == 2
    assert f"argument {flag}: '2.5' is not a whole number" in capsys.readouterr().err
    assert policy.read_bytes() == VALID


@pytest.mark.parametrize("command", [["keys", "create", "--team", "team-a"],
                                     ["keys", "update", "key_7Hq2"]])
@pytest.mark.parametrize("text", ["1e20", "2.5e19"])
def test_a_count_past_the_largest_limit_is_refused_as_too_large_not_as_a_fraction(
        command: list[str], text: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """1e20 is a whole number, too large for any limit (at most 2^53 - 1, as the policy's
    own check says). Before: "'1e20' is not a whole number" (create) and "--tokens-per-day
    must be a whole number" (update), which sent the operator looking for a fraction."""
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(VALID)
    try:
        code = main([*command, "--tokens-per-day", text, "--policy-file", str(policy)])
    except SystemExit as exc:  # create: argparse's refusal; update: the command's
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "whole" not in err and "at most 9007199254740991" in err, err
    assert policy.read_bytes() == VALID


@pytest.mark.parametrize("argv, flag", [
    (["envoy-config", "--record-heartbeat-s", "nan"], "--record-heartbeat-s"),
    (["envoy-config", "--record-heartbeat-s", "-1"], "--record-heartbeat-s"),
    (["hub", "allocate", "--bootstrap", CLOSED, "--interval-s", "nan"], "--interval-s"),
])
def test_a_period_that_is_not_a_positive_number_is_refused(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: envoy-config --record-heartbeat-s nan was a traceback, -1 printed a config
    with a negative heartbeat; hub allocate --interval-s nan ran, allocating without pause."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"argument {flag}: not a positive number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--listen", "--admin"])
def test_a_listener_named_by_host_name_is_one_line_not_a_traceback(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `envoy-config --listen localhost:10000` was a ValueError traceback, exit 1,
    where a bad --engine or --sidecar is one `error:` line naming the flag, exit 2."""
    assert main(["envoy-config", flag, "localhost:10000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag.removeprefix('--')}: 'localhost:10000' must be an IP"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["keys", "revoke"], ["keys", "enable"], ["keys", "show"],
                                     ["keys", "update", "--rps", "2"]])
def test_a_secret_given_for_a_key_id_is_said_and_not_echoed(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `error: no key sk-gw-...`: the whole secret printed again, to a terminal's
    scrollback or a CI log, and no word of what was wrong."""
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(VALID)
    secret = "sk-gw-key_7Hq2-l14VlfLWmJdYGmPtQavnK_8LANcQDx4JnuundZixbC0"
    assert main([*command[:2], secret, *command[2:], "--policy-file", str(policy)]) == 2
    err = capsys.readouterr().err
    assert "not its key id" in err and "'key_7Hq2'" in err and secret not in err, err
    assert parse_doc(policy.read_bytes()).revision == parse_doc(VALID).revision


def test_policy_apply_says_redis_is_what_does_not_answer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `error: Error 111 connecting to 127.0.0.1:1.`: nothing said it was Redis,
    nor which setting names it (the other commands say both)."""
    src = tmp_path / "p.yaml"
    src.write_bytes(VALID)
    assert main(["policy", "apply", str(src), "--redis-url", f"redis://{CLOSED}/0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: redis: ") and "GATEWAY_REDIS_URL" in err, err


def test_sentinels_that_do_not_answer_are_one_short_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `error: redis: No master found for 'spoke-a' : <redis.asyncio.client.Redis(
    <...ConnectionPool(<...Connection(db=0,username=<REDACTED>,...` on for ~2,000
    characters, the repr of every Sentinel's client."""
    url = f"redis+sentinel://:s3cret@{CLOSED}/spoke-a/0"
    assert main(["policy", "status", "--redis-url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: redis: No master found for 'spoke-a'"), err
    assert len(err) < 300 and "<redis" not in err and "s3cret" not in err, err


@pytest.mark.parametrize("command", [
    ["envoy-config"],
    ["policy", "show", "--policy-file", str(FIXTURES / "valid.yaml")],
    ["keys", "list", "--policy-file", str(FIXTURES / "valid.yaml")],
])
def test_a_reader_gone_before_the_output_is_no_traceback(command: list[str]) -> None:
    """`gateway ... | head -1`: head leaves; writing to its pipe fails (EPIPE). Before:
    a BrokenPipeError traceback (or 'Exception ignored' at exit, status 120)."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes anything
    try:
        proc = gateway_proc(*command, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err.decode()) == (0, "")


def test_ctrl_c_in_a_short_command_is_no_traceback() -> None:
    """`hub status` waiting on a Kafka that accepts but never answers, then Ctrl-C.
    Before: a KeyboardInterrupt traceback. After: exit 130, nothing on stderr."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        proc = gateway_proc("hub", "status", "--bootstrap", addr, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        silent.settimeout(60)
        conn, _ = silent.accept()  # the command is running: it has asked Kafka
        with conn:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err.decode()) == (130, "")


async def test_the_allocator_retrying_an_absent_kafka_leaves_no_consumer_open(
        caplog: pytest.LogCaptureFixture) -> None:
    """`gateway hub allocate` with Kafka away retries each second; before, each try left
    its consumer unclosed ('Unclosed AIOKafkaConsumer' on stderr at every retry)."""
    import asyncio
    import gc

    from gateway.hub.allocator import Allocator
    allocator = Allocator(CLOSED, 5.0, False, retry_s=0.1)
    stop = asyncio.Event()
    run = asyncio.create_task(allocator.run(stop))
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.wait_for(run, 10)
    gc.collect()
    await asyncio.sleep(0)
    assert "Unclosed AIOKafkaConsumer" not in caplog.text


def test_reading_a_policy_that_is_not_there_says_so(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`keys list` / `policy show` on a mistyped --policy-file printed an empty policy and
    nothing else, as if it held no keys: now a note on stderr names the missing file (the
    output, exit 0, is unchanged: the embedded mode's missing file is revision 0). A file
    written by hand, with no revision in it, gets no note."""
    missing = tmp_path / "polcy.yaml"
    for argv in (["keys", "list"], ["policy", "show", "-o", "json"]):
        assert main([*argv, "--policy-file", str(missing)]) == 0
        err = capsys.readouterr().err
        assert f"note: no policy yet ({missing} does not exist)" in err, err
    by_hand = tmp_path / "policy.yaml"
    by_hand.write_bytes(VALID)
    assert parse_doc(VALID, "valid").revision is None
    assert main(["keys", "list", "--policy-file", str(by_hand)]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", [
    ["policy", "show"],
    ["policy", "apply", "-"],
    ["keys", "list"],
    ["keys", "create", "--team", "t"],
])
def test_a_policy_command_with_no_store_named_is_a_usage_error(command: list[str]) -> None:
    """Neither GATEWAY_REDIS_URL nor GATEWAY_POLICY_FILE (nor their flags): a usage error,
    exit 2 as argparse's own, with an `error:` line. It was a bare line and exit 1, the code
    of a Redis that does not answer."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GATEWAY_REDIS_URL", "GATEWAY_POLICY_FILE")}
    done = subprocess.run([sys.executable, "-m", "gateway", *command], cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, input=VALID,
                          capture_output=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().splitlines() == [
        "error: no policy store: set GATEWAY_REDIS_URL or --redis-url (a spoke), or "
        "GATEWAY_POLICY_FILE or --policy-file (embedded mode)"]


@pytest.mark.parametrize(("argv", "names"), [
    ([], "{serve,dev,policy,hub,keys,usage,envoy-config}"),
    (["policy"], "{apply,show,status,sync,schema,check}"),
    (["keys"], "{create,mint,list,show,revoke,rotate,enable,update}"),
    (["usage"], "{tail,consume,report,reconcile}"),
])
def test_a_missing_command_is_named_by_its_choices(
        argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse named the parser's internal dest: `the following arguments are required:
    sub` (or `cmd`), a word in no help text."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: the following arguments are required: {names}")


@pytest.mark.parametrize(("name", "why"), [
    ("absent.yaml", "No such file or directory"),
    (".", "Is a directory"),
])
def test_a_policy_file_that_cannot_be_read_is_named_with_why(
        name: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was `nothing published: [Errno 2] No such file or directory: 'absent.yaml'`."""
    path = tmp_path / name
    assert main(["policy", "apply", str(path), "--policy-file", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"nothing published: cannot read {path}: {why}"]
