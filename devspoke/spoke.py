"""`gateway dev`: the whole local spoke in one command, with a demo policy and key."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import shutil
import signal
import socket
import sys
import time
from importlib import resources
from pathlib import Path
from types import FrameType

from devspoke.publish import policy_backend
from devspoke.stack import Spoke
from devspoke.usage_topic import USAGE_TOPIC, find_event
from gateway.policy import admin, key_edits
from gateway.settings import DEFAULT_METERING, Metering


async def apply_demo_policy(redis_url: str) -> key_edits.NewKey:
    text = resources.files("devspoke").joinpath("demo_policy.yaml").read_bytes()
    async with policy_backend(redis_url) as backend:
        await admin.apply(backend, text, "demo_policy.yaml")
        return await key_edits.create_key(backend, "demo", key_id="demo",
                                      limits={"rps": 20, "concurrency": 8})


def run_spoke(port: int, workdir: Path, otlp: str | None = None,
              metering: Metering = DEFAULT_METERING, drain_s: float = 5.0) -> int:
    workdir = workdir.resolve()
    problem = _port_taken(port) or _workdir_taken(workdir)
    if problem:
        print(f"gateway dev: {problem}", file=sys.stderr, flush=True)
        return 2
    spoke = Spoke(workdir=workdir, listen_port=port, otlp=otlp, metering=metering)
    # Ctrl-C stops the spoke even when this process was started with SIGINT ignored (a
    # background job of a script, a CI runner): a spoke nobody can interrupt outlives its user.
    interrupts = _Interrupts(spoke)
    signal.signal(signal.SIGINT, interrupts)
    print(f"starting the local spoke in {spoke.workdir} ({metering} metering) ...", flush=True)
    try:
        spoke.start()
        key = asyncio.run(apply_demo_policy(spoke.redis_url))
        try:
            spoke.wait_ready(timeout=10)  # the sidecar picks the announcement up in ms
        except TimeoutError as exc:
            print(f"  ({exc}; see {spoke['sidecar'].log_path})", flush=True)
        _banner(spoke, key.secret, drain_s)
        _demo_request(spoke, key.secret)
        stop = {"now": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        while not stop["now"]:
            for name, svc in spoke.services.items():
                if not svc.alive:
                    print(f"{name} exited; see {svc.log_path}", flush=True)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        interrupts.stopping = True  # from here on, a Ctrl-C kills instead of interrupting
        # A closed terminal or pipe (its reader gone) must not skip the stop: a failed print
        # here once left every service of the spoke running.
        with contextlib.suppress(OSError):
            print(f"\nstopping (requests in flight get {drain_s:g}s) ...", flush=True)
        spoke.stop(drain_s=drain_s)
    return 0


class _Interrupts:
    """The SIGINT handler: the first Ctrl-C interrupts whatever runs (KeyboardInterrupt), and
    the spoke stops gracefully; one that comes while it stops kills every service at once.
    The services run in their own sessions, so only this process hears Ctrl-C: a second one
    that broke off the graceful stop would leave them all running."""

    def __init__(self, spoke: Spoke) -> None:
        self.spoke = spoke
        self.stopping = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            for svc in self.spoke.services.values():
                svc.kill_now()
            return
        self.stopping = True
        raise KeyboardInterrupt


def _demo_request(spoke: Spoke, secret: str) -> None:
    """One request through Envoy, and the usage event it produced, read back from Kafka."""
    import httpx
    import orjson

    r = httpx.post(f"{spoke.base_url}/chat/completions", timeout=10,
                   headers={"authorization": f"Bearer {secret}"},
                   json={"model": "mock-model", "max_tokens": 5, "stream": True,
                         "messages": [{"role": "user", "content": "hello from gateway dev"}]})
    rid = r.headers.get("x-request-id", "")
    print(f"  demo request: HTTP {r.status_code}, x-request-id {rid}", flush=True)
    event = asyncio.run(find_event(spoke.kafka_bootstrap, rid))
    if event is None:
        print("  (its usage event did not arrive within 10 s; see the sidecar log)", flush=True)
        return
    print(f"  its usage event on {USAGE_TOPIC}:\n", flush=True)
    print(orjson.dumps(orjson.loads(event), option=orjson.OPT_INDENT_2).decode(), flush=True)


def _port_taken(port: int) -> str:
    """Envoy binds with SO_REUSEPORT, so a second spoke on a taken port would come up and
    share its requests with the first: check with a plain bind, which any listener blocks."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return (f"port {port} is already in use (another spoke?); pick one with --port, "
                    "and a work directory of its own with --workdir (make run ARGS='--port "
                    "10001 --workdir .gateway-dev-10001')")
    return ""


_LOCKS: list[object] = []  # held open for the process's life


def _workdir_taken(workdir: Path) -> str:
    """One spoke per work directory: their logs, spools and configs would mix."""
    workdir.mkdir(parents=True, exist_ok=True)
    f = open(workdir / ".lock", "w")  # noqa: SIM115 (kept open: the lock is the open file)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return f"{workdir} is in use by another spoke; pick another with --workdir"
    _LOCKS.append(f)
    return ""


def _banner(spoke: Spoke, secret: str, drain_s: float) -> None:
    s = spoke.services
    # The venv's own script, by its full path: pasteable without activating the venv.
    script = Path(sys.executable).with_name("gateway")
    gw = str(script) if script.exists() else shutil.which("gateway") or "gateway"
    door = f"  ext_authz HTTP door {spoke.authz_http_address}" if spoke.authz_http_address else ""
    print(f"""
  Envoy        http://127.0.0.1:{spoke.listen_port}   (every request goes through the sidecar)
  sidecar      {s['sidecar'].address}{door}  metrics {spoke.metrics_url}/metrics
  mock engine  {spoke.engine_url}      Redis {spoke.redis_url}
  Kafka        {spoke.kafka_bootstrap} (Tansu)  topic llm.usage.v1
  logs         {spoke.workdir}/

  demo key:    {secret}

  Try:
    curl -s http://127.0.0.1:{spoke.listen_port}/v1/chat/completions \\
      -H 'authorization: Bearer {secret}' -H 'content-type: application/json' \\
      -d '{{"model":"mock-model","messages":[{{"role":"user","content":"hello there"}}]}}'

    export KEY={secret} GATEWAY_SPOKE={spoke.spoke_id} \\
           GATEWAY_REDIS_URL={spoke.redis_url} GATEWAY_KAFKA_BOOTSTRAP={spoke.kafka_bootstrap} \\
           GATEWAY_KAFKA_IDEMPOTENCE=false   # Tansu: docs/kafka-broker.md
    {gw} policy show; {gw} keys list; {gw} policy status
    {gw} keys show demo      # its limits, and what is used and left now
    {gw} usage tail -n 5     # the last 5 usage events (-f: then follow)

  Ctrl-C stops everything (requests in flight first get {drain_s:g}s to finish).
""", flush=True)
