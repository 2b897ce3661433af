"""Hub and spokes for tests and benchmarks: one Kafka (Tansu) the hub and every spoke share,
and per spoke a whole Spoke (Redis, engine, sidecar, Envoy) plus its `gateway policy sync`.

The hub is the CLI (`gateway hub publish|status`), run as a user runs it. The spokes start
with no policy: the first `publish` reaches them through their syncers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from devspoke.procs import LOOPBACK, Service, free_port, tansu_service
from devspoke.stack import Spoke
from gateway.policy import secrets
from testkit.spoke import KEY_LIMITS, policy_doc


def syncer_service(spoke: Spoke, name: str, bootstrap: str, workdir: Path,
                   env: dict[str, str]) -> Service:
    """`gateway policy sync` for `spoke`; its port is its /metrics (ready = listening)."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "policy", "sync", "--id", f"{name}-sync",
            "--metrics-listen", f"{LOOPBACK}:{port}"]
    return Service(f"syncer-{name}", argv, port, workdir, env={
        "GATEWAY_REDIS_URL": spoke.redis_url, "GATEWAY_SPOKE": name,
        "GATEWAY_KAFKA_BOOTSTRAP": bootstrap, "GATEWAY_KAFKA_IDEMPOTENCE": "false",
        "GATEWAY_SYNC_STATE_DIR": str(workdir / "sync-state"), **env})


@dataclass
class Fleet:
    workdir: Path
    kafka: Service
    spokes: dict[str, Spoke] = field(default_factory=dict)
    syncers: dict[str, Service] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # key id → secret (the test policy)

    @property
    def bootstrap(self) -> str:
        return self.kafka.address

    def hub(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`gateway hub ARGV... --bootstrap` (this fleet's Kafka), as an operator runs it."""
        proc = subprocess.run([sys.executable, "-m", "gateway", "hub", *argv,
                               "--bootstrap", self.bootstrap],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "GATEWAY_KAFKA_IDEMPOTENCE": "false"})
        if check and proc.returncode != 0:
            raise AssertionError(f"gateway hub {' '.join(argv)}: exit {proc.returncode}\n"
                                 f"{proc.stdout}{proc.stderr}")
        return proc

    def publish(self, doc: dict[str, Any], spoke: str = "*") -> int:
        """`gateway hub publish` of `doc` for `spoke`; the revision it printed."""
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=self.workdir,
                                         delete=False) as f:
            yaml.safe_dump(doc, f)
        out = self.hub("publish", f.name, "--spoke", spoke).stdout.strip()
        said = re.fullmatch(r"published revision (\d+) for spoke (\S+)", out)
        assert said and said[2] == spoke, out  # the contract's line (DESIGN §10)
        return int(said[1])

    def status(self) -> dict[str, Any]:
        """`gateway hub status -o json`, by spoke: {spoke: {"feed_revision", "instances":
        {instance: {...}}}}."""
        view = orjson.loads(self.hub("status", "-o", "json").stdout)
        return {s["spoke"]: {"feed_revision": s["feed_revision"],
                             "instances": {i["instance"]: i for i in s["instances"]}}
                for s in view["spokes"]}

    def redis(self, name: str) -> redis.Redis:
        return redis.Redis.from_url(self.spokes[name].redis_url)

    def held(self, name: str) -> int:
        """The revision spoke `name`'s Redis holds."""
        return int(self.redis(name).hget("gw:policy", "revision") or 0)

    def wait(self, cond: Any, what: str, timeout: float = 15.0) -> float:
        """Poll `cond()` until true; seconds it took. AssertionError naming `what` after
        `timeout` (a bound on a hang, not a performance target: numbers go to benchmarks/)."""
        start = time.monotonic()
        last: Any = None
        while time.monotonic() - start < timeout:
            try:
                if cond():
                    return time.monotonic() - start
            except Exception as exc:  # e.g. a CLI that failed while Kafka is cut
                last = exc
            time.sleep(0.05)
        raise AssertionError(f"not within {timeout}s: {what} (last error: {last!r})")

    def wait_value(self, fn: Any, what: str, timeout: float = 30.0) -> Any:
        """`fn()`'s value once it stops raising (e.g. a CLI while Kafka comes back)."""
        box: list[Any] = []

        def done() -> bool:
            box.append(fn())
            return True

        self.wait(done, what, timeout)
        return box[-1]

    def stop(self) -> None:
        for svc in self.syncers.values():
            svc.stop()
        for spoke in self.spokes.values():
            spoke.stop()
        self.kafka.stop()


def start_fleet(workdir: Path, names: tuple[str, ...] = ("spoke-a", "spoke-b"), *,
                status_interval_s: float = 1.0, **spoke_kw: Any) -> Fleet:
    """A started fleet serving the test policy (testkit.spoke.policy_doc) from the feed."""
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir, tansu_service(free_port(), workdir))
    hub_env = {"GATEWAY_STATUS_INTERVAL_S": str(status_interval_s),
               "GATEWAY_POLICY_RECHECK_S": "1"}
    try:
        fleet.kafka.start()
        for name in names:
            spoke = Spoke(workdir=workdir / name, listen_port=free_port(),
                          kafka_bootstrap_shared=fleet.bootstrap, **spoke_kw)
            spoke.sidecar_env = {"GATEWAY_SPOKE": name, "GATEWAY_INSTANCE_ID": f"{name}-sidecar",
                                 **hub_env, **spoke.sidecar_env}
            fleet.spokes[name] = spoke.start()
            fleet.syncers[name] = syncer_service(
                spoke, name, fleet.bootstrap, workdir / name, hub_env).start()
        fleet.keys = {k: secrets.new_secret(k) for k in KEY_LIMITS}
        fleet.publish(policy_doc(fleet.keys))
        for spoke in fleet.spokes.values():
            spoke.wait_ready(timeout=20)
    except Exception:
        fleet.stop()
        raise
    return fleet
