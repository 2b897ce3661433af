"""`gateway dev` (= `make run`): the whole local spoke comes up, serves the demo key, shows
the demo request's usage event, and Ctrl-C stops everything."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from devspoke.procs import free_port, port_open
from devspoke.usage_topic import read_topic


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_dev(tmp_path: Path, port: int) -> tuple[subprocess.Popen[str], str]:
    """`gateway dev` on `port`, and its output up to the demo request's usage event."""
    # Started with SIGINT ignored, as a script's background job (or a CI runner) starts it:
    # Ctrl-C must stop it all the same (a CI run found one left running after the test).
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "dev", "--port", str(port), "--workdir",
         str(tmp_path / "dev")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_ignore_sigint)
    out = ""
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    while '"outcome": "completed"' not in out and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out += line
    return proc, out


def test_gateway_dev_runs_the_tour(tmp_path: Path) -> None:
    port = free_port()
    proc, out = _start_dev(tmp_path, port)
    try:
        assert '"outcome": "completed"' in out, out
        secret = next(ln.split()[-1] for ln in out.splitlines() if "demo key:" in ln)
        # the commands it prints run as printed, without an activated venv
        cmd = next(ln.split(";")[0].strip() for ln in out.splitlines()
                   if ln.strip().endswith("policy status"))
        assert cmd.split()[0].startswith("/") and Path(cmd.split()[0]).exists(), cmd
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       headers={"authorization": f"Bearer {secret}"},
                       json={"model": "mock-model", "messages": [], "max_tokens": 2})
        assert r.status_code == 200
        # its exports are all the hub's commands need against its Tansu (which has no
        # idempotent producers: without GATEWAY_KAFKA_IDEMPOTENCE=false a publish failed
        # with `kafka ...: UnknownError()`)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= _printed_exports(out)
        # and a `policy sync` run with them follows the feed for this spoke: without its id
        # it reported as spoke `local` and wrote that spoke's quota allowances into this
        # spoke's Redis
        spoke = re.search(r'"spoke": "([^"]+)"', out)  # the demo event's
        assert spoke is not None, out
        assert env.get("GATEWAY_SPOKE") == spoke[1], _printed_exports(out)
        gw = cmd.split()[0]
        doc = subprocess.run([gw, "policy", "show"], env=env, capture_output=True, text=True,
                             timeout=30, check=True).stdout
        (tmp_path / "p.yaml").write_text(doc)
        pub = subprocess.run([gw, "hub", "publish", str(tmp_path / "p.yaml"), "--spoke", "dev"],
                             env=env, capture_output=True, text=True, timeout=30)
        assert pub.returncode == 0 and "published revision" in pub.stdout, pub
    finally:
        # Nobody reads its output any more (a closed terminal): stopping must not need it.
        if proc.stdout is not None:
            proc.stdout.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert not port_open(port)  # Envoy is gone, and with it the rest


def _printed_exports(out: str) -> dict[str, str]:
    """The NAME=VALUE pairs of the banner's `export` statement (a `\\` continues it)."""
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("export "))
    text = ""
    for ln in lines[i:]:
        text += " " + ln.split("#")[0].strip()
        if not text.endswith("\\"):
            break
        text = text[:-1]
    return dict(w.split("=", 1) for w in text.split()[1:])


def test_a_second_ctrl_c_while_stopping_kills_every_service(tmp_path: Path) -> None:
    """The services run in their own sessions, so only `gateway dev` hears Ctrl-C. A second
    one during the graceful stop (an impatient user) must not leave them running: it kills
    them. Before, it broke off the stop with a traceback and every service lived on."""
    port = free_port()
    proc, out = _start_dev(tmp_path, port)
    banner = out.split("demo key:")[0]
    ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", banner)}
    assert port in ports and len(ports) >= 6, banner  # Envoy, sidecar, door, engine, Redis...
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)  # inside the stop: Envoy's drain alone waits 0.2 s
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    assert "Traceback" not in rest, rest
    deadline = time.monotonic() + 5
    while (alive := {p for p in ports if port_open(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"still listening: {alive}\n{rest}"


def test_gateway_dev_refuses_a_taken_port_or_work_directory(tmp_path: Path) -> None:
    """A second spoke on the same port would share its requests with the first (Envoy binds
    with SO_REUSEPORT); two in one work directory would mix their logs and spools."""
    import fcntl
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "gateway", "dev", "--port", str(taken),
                            "--workdir", str(tmp_path / "a")], capture_output=True, text=True,
                           timeout=30)
    assert r.returncode == 2 and f"port {taken} is already in use" in r.stderr
    (tmp_path / "b").mkdir()
    with open(tmp_path / "b" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = subprocess.run([sys.executable, "-m", "gateway", "dev", "--port", str(free_port()),
                            "--workdir", str(tmp_path / "b")], capture_output=True, text=True,
                           timeout=30)
    assert r.returncode == 2 and "in use by another spoke" in r.stderr


def test_the_taken_port_hint_starts_a_second_spoke_from_the_same_checkout(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A taken port's message says how to run another spoke. Its hint once named `--port`
    alone, and the second spoke, in the first's default work directory, was refused."""
    import fcntl
    import shlex
    import socket

    from devspoke import spoke
    from gateway.cli import parser

    monkeypatch.chdir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        hint = spoke._port_taken(s.getsockname()[1])
    m = re.search(r"ARGS='([^']*)'", hint)
    assert m, hint
    args = parser().parse_args(["dev", *shlex.split(m.group(1))])
    first = Path(parser().parse_args(["dev"]).workdir)
    first.mkdir()
    with open(first / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first spoke, running
        assert spoke._workdir_taken(Path(args.workdir)) == "", hint
    spoke._LOCKS.pop().close()  # type: ignore[attr-defined]


def test_stopping_gateway_dev_bills_a_stream_in_flight(tmp_path: Path) -> None:
    """Ctrl-C with a 10 s stream in flight: it gets the drain bound (2 s here) to finish,
    then the engine's stop cuts it, Envoy ends it and sends its record, and the sidecar turns
    it into its one event, delivered before Kafka stops; no admission is left to the sweep."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "dev", "--port", str(port), "--drain-s", "2",
         "--workdir", str(tmp_path / "dev")], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    out = ""
    while '"outcome": "completed"' not in out:
        line = proc.stdout.readline()
        assert line, out
        out += line
    secret = next(ln.split()[-1] for ln in out.splitlines() if "demo key:" in ln)
    kafka = re.search(r"Kafka\s+(\S+) \(Tansu\)", out)
    assert kafka, out
    seen: list[dict[str, object]] = []
    rid: list[str] = []

    def follow() -> None:  # the topic, read while the spoke stops (Tansu keeps it in memory)
        def keep(m: Any) -> bool:
            if m.value:
                seen.append(orjson.loads(m.value))
            return True
        asyncio.run(read_topic(kafka.group(1), keep, lambda: bool(rid) and any(
            e["event_id"] == rid[0] for e in seen), timeout=60, settle=0))

    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {secret}",
                               "x-mock-tokens-per-s": "50"},
                      json={"model": "mock-model", "max_tokens": 500, "stream": True,
                            "messages": [{"role": "user", "content": "a long story"}]}) as r:
        rid.append(r.headers["x-request-id"])
        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(httpx.HTTPError):
            for _ in r.iter_raw():
                pass
    rest, _ = proc.communicate(timeout=60)
    reader.join(30)
    assert "cutting the streams still running after 2s" in rest, rest
    [event] = [e for e in seen if e["event_id"] == rid[0]]
    assert event["outcome"] == "upstream_error"  # cut by the stop, billed what it streamed
    usage = event["usage"]
    assert isinstance(usage, dict) and int(usage["completion_tokens"]) > 0, event
    assert event["usage_source"] == "estimated"  # from what it streamed until the cut
    sidecar_log = next((tmp_path / "dev").glob("sidecar-*.log")).read_text()
    assert "orphaned_request" not in sidecar_log and "admissions_unheard" not in sidecar_log
