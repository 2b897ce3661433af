"""`gateway usage tail` on a real Tansu: the last N by time, `-f` in time order, and quiet
when its reader goes away (`| head`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from devspoke.procs import Service, free_port, tansu_service


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = tansu_service(free_port(), tmp_path_factory.mktemp("tansu")).start()
    yield svc
    svc.stop()


def ev(second: int, inst: str, seq: int) -> bytes:
    return orjson.dumps({"event_id": f"{inst}-{seq}", "instance_id": inst, "seq": str(seq),
                         "ended_at": f"2026-12-01T10:{second // 60:02d}:{second % 60:02d}.000Z"})


async def put(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await p.start()
    try:
        for v in values:
            await p.send(topic, key=orjson.loads(v)["event_id"].encode(), value=v)
        await p.flush()
    finally:
        await p.stop()


def tail_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway", "usage", "tail", *args]


def env(tansu: Service, topic: str) -> dict[str, str]:
    return {**os.environ, "GATEWAY_KAFKA_BOOTSTRAP": tansu.address,
            "GATEWAY_USAGE_TOPIC": topic}


# in the order Kafka holds them, not the order they ended in
SHUFFLED = [ev(3, "a", 3), ev(1, "b", 1), ev(5, "a", 4), ev(2, "b", 2), ev(0, "a", 2)]


def seconds(lines: list[str]) -> list[int]:
    return [int(orjson.loads(line)["ended_at"][17:19]) for line in lines]


async def test_tail_n_prints_the_last_n_by_time(tansu: Service) -> None:
    await put(tansu.address, "usage.t1", SHUFFLED)
    out = subprocess.run(tail_cmd("-n", "3"), env=env(tansu, "usage.t1"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert seconds(out.stdout.splitlines()) == [2, 3, 5]
    out = subprocess.run(tail_cmd(), env=env(tansu, "usage.t1"), capture_output=True,
                         text=True, timeout=60)
    assert seconds(out.stdout.splitlines()) == [0, 1, 2, 3, 5]


async def test_follow_prints_the_backlog_in_time_order_then_new_events(tansu: Service) -> None:
    await put(tansu.address, "usage.t2", SHUFFLED)
    # Ctrl-C as a terminal sends it: SIGINT at its default in the child even when this run
    # was started with it ignored (a background job of a script), which Python inherits.
    proc = subprocess.Popen(tail_cmd("-f"), env=env(tansu, "usage.t2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        backlog = [proc.stdout.readline() for _ in SHUFFLED]
        assert seconds(backlog) == [0, 1, 2, 3, 5]
        await put(tansu.address, "usage.t2", [ev(7, "b", 3)])
        assert seconds([proc.stdout.readline()]) == [7]  # still following
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err


async def test_a_closed_pipe_ends_tail_quietly(tansu: Service) -> None:
    # far more than a pipe's buffer, so tail is still writing when head leaves
    await put(tansu.address, "usage.t3", [ev(i % 3600, "c", i + 1) for i in range(3000)])
    proc = subprocess.Popen(tail_cmd("--pretty"), env=env(tansu, "usage.t3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -n 1` does once it has its line
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.wait(timeout=60) == 0
    assert first.strip() == b"{" and err == ""

