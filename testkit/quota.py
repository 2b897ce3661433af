"""One quota across spokes, for tests and benchmarks: spokes sharing one Tansu, the hub's
allocator and the spokes' allowance followers as processes, load until denied."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
from openai.types.chat import ChatCompletionUserMessageParam

from devspoke.procs import free_port
from devspoke.stack import Spoke
from gateway.authz.prompt_estimate import estimate_prompt_tokens
from gateway.hub.quota_topic import POLICY_TOPIC

PROMPT: list[ChatCompletionUserMessageParam] = [  # what `drive` sends
    {"role": "user", "content": "hello there"}]
PROMPT_TOKENS = 2  # what the mock engine counts for it


def past_reservation(max_tokens: int) -> int:
    """What one `drive` request can use past its reservation, (actual - reserved)+: the
    overshoot bound's in-flight term per request (README "One quota across spokes"). The
    mock engine answers with exactly `max_tokens`, so the prompt estimate decides."""
    reserved = estimate_prompt_tokens({"messages": PROMPT}) + max_tokens
    return max(0, PROMPT_TOKENS + max_tokens - reserved)


class Proc:
    """A port-less long-running child (the allocator, a follower), its output in a log."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.env = name, argv, {**os.environ, **env}
        self.log_path = workdir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=self.env,
                                          start_new_session=True)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, words: str, timeout: float = 30.0, after: int = 0) -> None:
        """Until `words` appears in the log past character `after`."""
        deadline = time.monotonic() + timeout
        while words not in self.log()[after:]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {words!r} in {timeout}s:\n"
                                   f"{self.log()[-3000:]}")
            time.sleep(0.1)


def hub_env(bootstrap: str, **extra: str) -> dict[str, str]:
    return {"GATEWAY_KAFKA_BOOTSTRAP": bootstrap, "GATEWAY_KAFKA_IDEMPOTENCE": "false",
            "PYTHONUNBUFFERED": "1", **extra}


def allocator(bootstrap: str, workdir: Path, interval_s: float) -> Proc:
    return Proc("allocator", [sys.executable, "-m", "gateway", "hub", "allocate",
                              "--interval-s", str(interval_s)], workdir, hub_env(bootstrap))


def follower(bootstrap: str, spoke: str, redis_url: str, workdir: Path) -> Proc:
    """The spoke's `gateway policy sync`: its revisions and its allowances."""
    return Proc(f"follower-{spoke}", [
        sys.executable, "-m", "gateway", "policy", "sync", "--id", f"{spoke}-sync",
        "--metrics-listen", f"127.0.0.1:{free_port()}"], workdir,
        hub_env(bootstrap, GATEWAY_SPOKE=spoke, GATEWAY_REDIS_URL=redis_url,
                GATEWAY_SYNC_STATE_DIR=str(workdir / f"sync-{spoke}")))


def spoke_on(workdir: Path, name: str, bootstrap: str) -> Spoke:
    """A whole spoke (Redis, engine, sidecar, Envoy) reporting usage to a shared Kafka."""
    return Spoke(workdir=workdir, listen_port=free_port(), kafka=False, sidecar_env={
        "GATEWAY_KAFKA_BOOTSTRAP": bootstrap, "GATEWAY_KAFKA_IDEMPOTENCE": "false",
        "GATEWAY_SPOKE": name}).start()


def publish_feed(bootstrap: str, doc: dict[str, Any], revision: int, key: str = "*") -> None:
    """Put a policy on the hub's feed, as `gateway hub publish` does (DESIGN §10)."""
    from aiokafka import AIOKafkaProducer

    async def send() -> None:
        p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await p.start()
        try:
            await p.send_and_wait(POLICY_TOPIC, key=key.encode(),
                                  value=orjson.dumps({"revision": revision, "policy": doc}))
        finally:
            await p.stop()

    asyncio.run(send())


@dataclass
class Drive:
    """What a load of one key through one spoke got."""

    served_tokens: int = 0
    served: int = 0
    denied: int = 0
    codes: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


def drive(spoke: Spoke, key: str, *, concurrency: int, max_tokens: int,
          until_denied_for: float, max_s: float = 90.0, stop: threading.Event | None = None,
          until_tokens: int | None = None) -> Drive:
    """Requests through the spoke's Envoy, `concurrency` at a time, until every answer for
    `until_denied_for` seconds was a 429 (or `max_s`, or `stop`, or `until_tokens` served)."""
    out = Drive()
    client = openai.OpenAI(base_url=spoke.base_url, api_key=key, max_retries=0)
    last_ok = [time.monotonic()]
    end = time.monotonic() + max_s
    stop = stop or threading.Event()

    def worker() -> None:
        while time.monotonic() < end and not stop.is_set():
            if time.monotonic() - last_ok[0] > until_denied_for:
                return
            if until_tokens is not None and out.served_tokens >= until_tokens:
                return
            try:
                r = client.chat.completions.create(
                    model="mock-model", max_tokens=max_tokens, messages=PROMPT)
            except openai.RateLimitError as exc:
                with out.lock:
                    out.denied += 1
                    out.codes.add(str(exc.code))
                time.sleep(0.05)
                continue
            with out.lock:
                out.served += 1
                out.served_tokens += r.usage.total_tokens if r.usage else 0
                last_ok[0] = time.monotonic()

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return out


def quota_doc(keys: dict[str, str], quota: int) -> dict[str, Any]:
    """One team per key (key 'k<team>' of team '<team>'), each with a global daily quota."""
    from gateway.policy import secrets
    return {
        "models": {"mock-model": {}},
        "teams": {k[1:]: {"models": ["*"], "global_limits": {"tokens_per_day": quota}}
                  for k in keys},
        "keys": {k: {"team": k[1:], "sha256": secrets.digest(s).hex()} for k, s in keys.items()},
    }


@dataclass
class Fleet:
    kafka: Any  # the shared Tansu (a devspoke.procs.Service)
    spokes: dict[str, Spoke]
    keys: dict[str, str]  # key id → secret
    procs: list[Proc]
    workdir: Path


@contextlib.contextmanager
def fleet(workdir: Path, teams: list[str], quota: int,
          names: tuple[str, ...] = ("east", "west")) -> Iterator[Fleet]:
    """Whole spokes on one Tansu, serving one policy (on their Redis and on the hub's feed),
    each with its allowance follower; no allocator yet. Everything stops on exit."""
    from devspoke.procs import tansu_service
    from devspoke.publish import publish
    from gateway.policy import secrets

    kafka = tansu_service(free_port(), workdir).start()
    out = Fleet(kafka, {}, {f"k{t}": secrets.new_secret(f"k{t}") for t in teams}, [], workdir)
    try:
        for name in names:
            out.spokes[name] = spoke_on(workdir / name, name, kafka.address)
        doc = quota_doc(out.keys, quota)
        for s in out.spokes.values():
            publish(s.redis_url, doc, "quota", prune=True)
            s.wait_ready(timeout=30)
        publish_feed(kafka.address, doc, revision=1)
        for name, s in out.spokes.items():
            out.procs.append(follower(kafka.address, name, s.redis_url, workdir).start())
        yield out
    finally:
        for p in out.procs:
            p.stop()
        for s in out.spokes.values():
            s.stop()
        kafka.stop()


def together(*loads: Callable[[], Drive]) -> list[Drive]:
    """Run the loads at once, each in its own thread; their results in order."""
    with ThreadPoolExecutor(len(loads)) as pool:
        return [f.result() for f in [pool.submit(load) for load in loads]]
