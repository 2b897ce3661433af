"""Envoy's records over OTLP/HTTP (`gateway envoy-config --records-http`), against the real
Envoy 1.40: a spoke so configured meters every request through the sidecar's
GATEWAY_RECORDS_HTTP_LISTEN; the rendered config's records reach a collector as the
sidecar's parser reads them, and Envoy sends each batch once, whatever the answer
(docs/envoy.md §6.9): the reason gRPC, which Envoy retries, stays the default. If a later
Envoy retries, this test says so."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devspoke.envoy_proc import envoy_service
from devspoke.procs import LOOPBACK, free_port
from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from gateway.server.records_http import CONTENT_TYPE, PATH, read_request
from testkit.spoke import client, read_events, start_spoke

REQUESTS = 4


class Collector:
    """A loopback OTLP/HTTP collector on its own loop: every request it got (path,
    content type, request ids), answered `status` (or, with "close", the connection cut)."""

    def __init__(self, status: str) -> None:
        self.status = status
        self.got: list[tuple[str, str, list[str]]] = []
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._serve, LOOPBACK, self.port))
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = bytearray()
        while data := await reader.read(65536):
            buf += data
            while got := read_request(buf, 1 << 22):
                req, taken = got
                del buf[:taken]
                batch = otlp.ExportLogsServiceRequest.FromString(req.body)
                rids = [kv.value.string_value for rl in batch.resource_logs
                        for sl in rl.scope_logs for lr in sl.log_records
                        for kv in lr.attributes if kv.key == "rid"]
                self.got.append((req.path, req.headers.get("content-type", ""), rids))
                if self.status == "close":
                    writer.close()
                    return
                writer.write(f"HTTP/1.1 {self.status}\r\ncontent-length: 0\r\n\r\n".encode())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(params=["200 OK", "503 Service Unavailable", "close"])
def collector(request: pytest.FixtureRequest) -> Iterator[Collector]:
    c = Collector(request.param)
    yield c
    c.stop()


def test_each_batch_is_sent_once_whatever_the_answer(tmp_path: Path,
                                                     collector: Collector) -> None:
    """Nothing listens at the sidecar's Check door, so Envoy answers each request itself
    (503); each still has its record, in a batch of its own (spaced past the 50 ms flush)."""
    listen, admin = free_port(), free_port()
    ports = EnvoyPorts(listen=f"{LOOPBACK}:{listen}", sidecar=f"{LOOPBACK}:{free_port()}",
                       engine=f"{LOOPBACK}:{free_port()}", admin=f"{LOOPBACK}:{admin}",
                       authz_http=f"{LOOPBACK}:{free_port()}",
                       records_http=f"{LOOPBACK}:{collector.port}")
    envoy = envoy_service(render(ports), admin, listen, tmp_path).start()
    try:
        for _ in range(REQUESTS):
            try:
                urllib.request.urlopen(f"http://{LOOPBACK}:{listen}/v1/models", timeout=5)
            except urllib.error.HTTPError as exc:
                assert exc.code == 503
            time.sleep(0.25)
        time.sleep(3)  # long past any retry back-off
        stats = urllib.request.urlopen(f"http://{LOOPBACK}:{admin}/stats?filter="
                                       "open_telemetry_access_log", timeout=5).read().decode()
    finally:
        envoy.stop()
    assert {(path, ctype) for path, ctype, _ in collector.got} == {(PATH, CONTENT_TYPE)}
    rids = [rid for _, _, batch in collector.got for rid in batch]
    assert len(rids) == len(set(rids)) == REQUESTS, collector.got  # once each, never again
    outcome = "logs_written" if collector.status.startswith("200") else "logs_dropped"
    assert f"open_telemetry_access_log.{outcome}: " in stats, stats


def test_a_spoke_meters_through_its_records_listener(tmp_path: Path) -> None:
    """Completed requests and a denied one: each its one event, the real usage."""
    spoke, keys = start_spoke(tmp_path / "spoke", metering="envoy", records_http=True)
    try:
        good = client(spoke, keys["good"])
        completed = [_rid(good) for _ in range(3)]
        denied = _rid(client(spoke, keys["expired"]))
        events = read_events(spoke.kafka_bootstrap, {*completed, denied})
    finally:
        spoke.stop()
    by_id = {e["event_id"]: e for e in events}
    assert len(events) == len(by_id) == 4, events  # each once
    assert all(by_id[r]["outcome"] == "completed"
               and int(by_id[r]["usage"]["completion_tokens"]) == 4 for r in completed), events
    assert by_id[denied]["outcome"] != "completed"


def _rid(c: openai.OpenAI) -> str:
    """The request id of one chat completion, answered or refused."""
    try:
        raw = c.chat.completions.with_raw_response.create(
            model="mock-model", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    except openai.APIStatusError as exc:
        return str(exc.response.headers["x-request-id"])
    return str(raw.headers["x-request-id"])
