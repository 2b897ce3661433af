"""gateway/envoyconf/lua/metering.lua in the real Envoy 1.40, between a client and a tiny engine.

No ext_authz here: a test-only Lua filter ahead of the product filter writes the facts the
sidecar would (namespace envoy.filters.http.ext_authz) from x-facts-* request headers, and a
set_metadata filter (disabled on every route but /static/) writes them as a protobuf Struct,
as ext_authz does. The engine sends SSE split into chunks with short pauses, so Envoy reads
them separately; the counters are read back from a file access log.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devspoke.envoy_proc import envoy_service
from devspoke.procs import LOOPBACK, Service, free_port
from gateway.envoyconf import lua as envoy_lua

AUTHZ_NS = "envoy.filters.http.ext_authz"
PAUSE = 0.003  # between upstream writes: long enough for Envoy to see separate reads

# Test-only: what ext_authz would write, taken from request headers. The splice is hex, so
# any bytes can travel in a header.
FAKE_AUTHZ_LUA = """
function envoy_on_request(handle)
  local h = handle:headers()
  local meta = handle:streamInfo():dynamicMetadata()
  local ns = "envoy.filters.http.ext_authz"
  local splice = h:get("x-facts-splice-hex")
  if splice then
    meta:set(ns, "splice", (splice:gsub("%x%x", function(x)
      return string.char(tonumber(x, 16)) end)))
  end
  for _, key in ipairs({"splice_at", "splice_cut"}) do
    local v = h:get("x-facts-" .. key)
    if v then meta:set(ns, key, tonumber(v)) end
  end
  for _, key in ipairs({"hide_usage", "hide_continuous"}) do
    if h:get("x-facts-" .. key) then meta:set(ns, key, true) end
  end
end
"""

# A NUL inside: a Struct string reaches Lua whole (get() is NUL-safe), while a string a Lua
# script set()s is cut at its first NUL, so FAKE_AUTHZ_LUA cannot carry NULs.
STATIC_SPLICE = ',"injected":"nul\x00byte"'
NO_STATIC = "{'@type': type.googleapis.com/envoy.config.route.v3.FilterConfig, disabled: true}"

ENVOY_YAML = """\
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {access_log}
              log_format:
                text_format_source:
                  inline_string: "%REQ(X-TEST-ID)% %DYNAMIC_METADATA(llm.stream:content_events)% %DYNAMIC_METADATA(llm.stream:content_chars)% %RESPONSE_FLAGS%\\n"
          route_config:
            virtual_hosts:
            - name: engine
              domains: ['*']
              routes:
              - match: {{prefix: /static/}}
                route: {{cluster: engine, timeout: 10s}}
              - match: {{prefix: /raw/}}
                route: {{cluster: raw_engine, timeout: 10s}}
                typed_per_filter_config: {{static_facts: {no_static}}}
              - match: {{prefix: /}}
                route: {{cluster: engine, timeout: 10s}}
                typed_per_filter_config: {{static_facts: {no_static}}}
          http_filters:
          - name: static_facts
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.filters.http.ext_authz
                allow_overwrite: true
                value: {{splice: {static_splice}, splice_at: 6, splice_cut: 0}}
          - name: fake_authz
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
{fake_authz}
          - name: envoy.filters.http.lua
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
{metering}
          - name: envoy.filters.http.router
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: engine
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: engine
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {engine}}}}}}}
  - name: raw_engine
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        '@type': type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: {{enable_trailers: true}}
    load_assignment:
      cluster_name: raw_engine
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {raw}}}}}}}
"""  # noqa: E501 (type URLs and the log format do not wrap)


def indent(text: str, spaces: int = 18) -> str:
    return "\n".join((" " * spaces + line) if line else "" for line in text.splitlines())


# --- the engine: aiohttp on its own loop, plus a raw socket one for trailers ----------------


@dataclass
class Script:
    """What the engine answers for one x-test-id."""

    chunks: list[bytes]
    content_type: str = "text/event-stream"
    status: int = 200
    sized: bool = False  # content-length framing instead of chunked
    gate: threading.Event | None = None  # wait for it after the first chunk
    seen: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port, self.raw_port = free_port(), free_port()
        self.runner: web.AppRunner | None = None
        self.raw_server: asyncio.AbstractServer | None = None

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, LOOPBACK, self.port).start()
        self.raw_server = await asyncio.start_server(self._raw, LOOPBACK, self.raw_port)

    async def _stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.raw_server is not None:
            self.raw_server.close()
            await self.raw_server.wait_closed()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path.endswith("/echo"):  # what the engine received, for splice tests
            return web.json_response({
                "body": body.hex(),
                "content_length": request.headers.get("content-length"),
                "transfer_encoding": request.headers.get("transfer-encoding"),
            })
        script = self.scripts[request.headers["x-test-id"]]
        resp = web.StreamResponse(status=script.status,
                                  headers={"content-type": script.content_type})
        if script.sized:
            resp.content_length = sum(map(len, script.chunks))
        await resp.prepare(request)
        for i, chunk in enumerate(script.chunks):
            await resp.write(chunk)
            await asyncio.sleep(PAUSE)
            if i == 0 and script.gate is not None:
                deadline = time.monotonic() + 5
                while not script.gate.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
        await resp.write_eof()
        return resp

    async def _raw(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/1.1 by hand: a chunked SSE answer that ends with trailers, then the
        connection closed, which its `connection: close` says (without it Envoy pooled the
        connection, and the next request could take it as it closed: Envoy's 503, once in a
        full run)."""
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            test_id = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                           if line.lower().startswith("x-test-id:"))
            script = self.scripts[test_id]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\ntrailer: x-done\r\n"
                         b"connection: close\r\n\r\n")
            for chunk in script.chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                await asyncio.sleep(PAUSE)
            writer.write(b"0\r\nx-done: 1\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()


@dataclass
class Stack:
    engine: Engine
    envoy: Service
    access_log: Path

    def send(self, path: str, body: bytes = b"{}", headers: dict[str, str] | None = None,
             timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(LOOPBACK, self.envoy.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def stream(self, script: Script, facts: dict[str, str] | None = None,
               path: str = "/v1/chat/completions") -> tuple[bytes, tuple[str, str]]:
        """Send one request answered by `script`: (body received, (events, chars) logged)."""
        test_id = uuid.uuid4().hex
        self.engine.scripts[test_id] = script
        try:
            status, _, body = self.send(path, headers={"x-test-id": test_id, **(facts or {})})
        finally:
            del self.engine.scripts[test_id]
        assert status == script.status
        return body, self.logged(test_id)

    def logged(self, test_id: str, timeout: float = 5) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.access_log.exists():
                for line in self.access_log.read_text().splitlines():
                    fields = line.split()
                    if fields and fields[0] == test_id:
                        return fields[1], fields[2]
            time.sleep(0.01)
        raise AssertionError(f"no access log line for {test_id}:\n{self.envoy.log_tail()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("lua_envoy")
    engine = Engine()
    engine.start()
    admin, listen = free_port(), free_port()
    access_log = workdir / "access.log"
    config = ENVOY_YAML.format(
        admin=admin, listen=listen, engine=engine.port, raw=engine.raw_port,
        access_log=access_log, static_splice=json.dumps(STATIC_SPLICE), no_static=NO_STATIC,
        fake_authz=indent(FAKE_AUTHZ_LUA), metering=indent(envoy_lua.source()),
    )
    filters = yaml.safe_load(config)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]["http_filters"]
    assert filters[2]["typed_config"]["default_source_code"]["inline_string"] == (
        envoy_lua.source().rstrip("\n") + "\n")  # the YAML carries the file unchanged
    envoy = envoy_service(config, admin, listen, workdir, flush_ms=10)  # log lines in ~10 ms
    try:
        envoy.start()
        yield Stack(engine, envoy, access_log)
    finally:
        envoy.stop()
        engine.stop()
    errors = [line for line in envoy.log_tail(20000).splitlines() if "[lua]" in line]
    assert not errors, "\n".join(errors)  # no script error in the whole module


# --- streams -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    raw: bytes
    hide_usage: bytes
    hide_continuous: bytes
    chars: int

    def expected(self, hide_usage: bool, hide_continuous: bool) -> bytes:
        if hide_usage and self.hide_usage == b"":
            return b""
        out = self.raw
        if hide_usage:
            out = self.hide_usage
        if hide_continuous and self.hide_continuous != self.raw:
            out = self.hide_continuous
        return out


def _same(raw: bytes, chars: int = 0) -> Event:
    return Event(raw, raw, raw, chars)


EVENTS = [
    Event(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}],"usage":null}\n\n',
          b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
          b'data: {"choices":[{"delta":{"role":"assistant","content":""}}],"usage":null}\n\n',
          0),
    Event('data: {"choices":[{"delta":{"content":"Hé"}}],"usage":null}\n\n'.encode(),
          'data: {"choices":[{"delta":{"content":"Hé"}}]}\n\n'.encode(),
          'data: {"choices":[{"delta":{"content":"Hé"}}],"usage":null}\n\n'.encode(),
          3),
    Event(b'data: {"choices":[{"delta":{"content":"llo"}}],'
          b'"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\r\n\r\n',
          b'data: {"choices":[{"delta":{"content":"llo"}}],'
          b'"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\r\n\r\n',
          b'data: {"choices":[{"delta":{"content":"llo"}}]}\r\n\r\n',
          3),
    Event('data: {"usage": null, "choices": [{"delta": {"reasoning_content": "思考"}}]}\n\n'
          .encode(),
          'data: {"choices": [{"delta": {"reasoning_content": "思考"}}]}\n\n'.encode(),
          'data: {"usage": null, "choices": [{"delta": {"reasoning_content": "思考"}}]}\n\n'
          .encode(),
          6),
    Event(b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n',
          b"",
          b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n',
          0),
    _same(b"data: [DONE]\n\n"),
    _same(b'event: response.output_text.delta\r\n'
          b'data: {"type":"response.output_text.delta","delta":"ok \\"q\\""}\r\n\r\n', 8),
    _same(b": keep-alive\n\n"),
]
TAILS = [b"", b'data: {"choices":[{"delta":{"content":"cut', "data: é".encode()]


@st.composite
def sse_case(draw: st.DrawFn) -> tuple[list[Event], bytes, list[bytes]]:
    events = draw(st.lists(st.sampled_from(EVENTS), min_size=1, max_size=8))
    tail = draw(st.sampled_from(TAILS))
    raw = b"".join(e.raw for e in events) + tail
    cuts = sorted(draw(st.sets(st.integers(1, len(raw) - 1), max_size=8)))
    edges = [0, *cuts, len(raw)]
    return events, tail, [raw[a:b] for a, b in itertools.pairwise(edges)]


def facts(hide_usage: bool, hide_continuous: bool) -> dict[str, str]:
    headers = {}
    if hide_usage:
        headers["x-facts-hide_usage"] = "1"
    if hide_continuous:
        headers["x-facts-hide_continuous"] = "1"
    return headers


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=sse_case(), hide=st.tuples(st.booleans(), st.booleans()), sized=st.booleans())
def test_split_streams_through_envoy(
    stack: Stack, case: tuple[list[Event], bytes, list[bytes]], hide: tuple[bool, bool],
    sized: bool,
) -> None:
    """Whatever the upstream reads, the client gets the model's bytes (the unterminated tail
    flushed at the end, chunked or sized framing) and the access log the model's counters."""
    events, tail, chunks = case
    body, counters = stack.stream(Script(chunks, sized=sized), facts(*hide))
    assert body == b"".join(e.expected(*hide) for e in events) + tail
    counted = [e.chars for e in events if e.chars]
    assert counters == (str(len(counted)), str(sum(counted)))


def read_some(resp: http.client.HTTPResponse, n: int) -> bytes:
    """The first `n` bytes of the body, returning as soon as they are there."""
    got = b""
    while len(got) < n:
        more = resp.read1(n - len(got))
        if not more:
            break
        got += more
    return got


def test_counting_alone_holds_nothing_back(stack: Stack) -> None:
    """With no hide flag, half an event reaches the client before the engine sends the rest."""
    gate = threading.Event()
    first = b'data: {"choices":[{"delta":{"content":"a'
    script = Script([first, b'b"}}]}\n\n'], gate=gate)
    test_id = uuid.uuid4().hex
    stack.engine.scripts[test_id] = script
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy.port, timeout=5)
    try:
        conn.request("POST", "/v1/chat/completions", body=b"{}", headers={"x-test-id": test_id})
        resp = conn.getresponse()
        assert read_some(resp, len(first)) == first  # before the gate opens
        gate.set()
        assert resp.read() == b'b"}}]}\n\n'
    finally:
        conn.close()
        del stack.engine.scripts[test_id]
    assert stack.logged(test_id) == ("1", "2")


@pytest.mark.parametrize("content_type", ["application/json", "text/plain"])
def test_non_streams_pass_whole_and_unheld_even_with_flags(
    stack: Stack, content_type: str
) -> None:
    """A JSON error split mid-way with both flags set: every byte arrives as sent, the first
    part before the engine sends the rest (a filter that held tails hung these)."""
    gate = threading.Event()
    parts = [b'{"error":{"message":"bad', b' request"},"usage":null}']
    script = Script(parts, content_type=content_type, status=400, gate=gate)
    test_id = uuid.uuid4().hex
    stack.engine.scripts[test_id] = script
    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy.port, timeout=5)
    try:
        conn.request("POST", "/v1/chat/completions", body=b"{}",
                     headers={"x-test-id": test_id, **facts(True, True)})
        resp = conn.getresponse()
        assert resp.status == 400
        assert read_some(resp, len(parts[0])) == parts[0]
        gate.set()
        assert resp.read() == parts[1]
    finally:
        conn.close()
        del stack.engine.scripts[test_id]
    assert stack.logged(test_id) == ("-", "-")  # not a stream: no counters


def test_trailers_end_loses_the_held_tail(stack: Stack) -> None:
    """Pins Envoy 1.40's behaviour: a body that ends with trailers ends the chunk loop in a
    later resume, when the last chunk has already gone; the unterminated tail held back for
    rewriting cannot be appended and is lost (without a script error). Counting-only streams
    hold nothing, so they lose nothing."""
    chunks = [b"data: [DONE]\n\n", b'data: {"cut']
    body, counters = stack.stream(Script(chunks), facts(True, False), path="/raw/x")
    assert body == b"data: [DONE]\n\n"
    assert counters == ("0", "0")
    body, _ = stack.stream(Script(chunks), path="/raw/x")
    assert body == b"".join(chunks)


# --- request splice ------------------------------------------------------------------------


def echo(stack: Stack, body: bytes, headers: dict[str, str],
         path: str = "/v1/echo") -> dict[str, Any]:
    status, _, answer = stack.send(path, body, headers)
    assert status == 200, answer
    seen: dict[str, Any] = json.loads(answer)
    seen["body"] = bytes.fromhex(seen["body"])
    return seen


def splice_facts(splice: bytes, at: int, cut: int | None = None) -> dict[str, str]:
    headers = {"x-facts-splice-hex": splice.hex(), "x-facts-splice_at": str(at)}
    if cut is not None:
        headers["x-facts-splice_cut"] = str(cut)
    return headers


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(src=st.binary(min_size=1, max_size=300), data=st.data(),
       splice=st.binary(max_size=60).filter(lambda b: b"\x00" not in b))  # see STATIC_SPLICE
def test_splice_reaches_the_engine_byte_exact(
    stack: Stack, src: bytes, splice: bytes, data: st.DataObject
) -> None:
    at = data.draw(st.integers(0, len(src) + 1))
    cut = data.draw(st.integers(0, 4))
    seen = echo(stack, src, splice_facts(splice, at, cut))
    fits = at + cut <= len(src)
    expected = src[:at] + splice + src[at + cut:] if fits else src
    assert seen["body"] == expected
    assert seen["content_length"] == str(len(expected))


def test_splice_into_a_chunked_request(stack: Stack) -> None:
    """A chunked upload leaves Envoy sized: the engine sees content-length, no chunking."""
    src = b'{"model":"m","stream":true}'
    inject = b',"stream_options":{"include_usage":true}'

    def chunks() -> Iterator[bytes]:
        yield src[:10]
        yield src[10:]

    conn = http.client.HTTPConnection(LOOPBACK, stack.envoy.port, timeout=5)
    try:
        conn.request("POST", "/v1/echo", body=chunks(), encode_chunked=True,
                     headers={"transfer-encoding": "chunked",
                              **splice_facts(inject, len(src) - 1)})
        seen = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    assert bytes.fromhex(seen["body"]) == src[:-1] + inject + b"}"
    assert seen["content_length"] == str(len(src) + len(inject))
    assert seen["transfer_encoding"] is None


def test_splice_offsets_from_a_protobuf_struct(stack: Stack) -> None:
    """set_metadata writes a Struct, like ext_authz: numbers reach Lua as numbers (doubles),
    and a string with a NUL byte arrives whole."""
    seen = echo(stack, b'{"a":1}', {}, path="/static/echo")
    assert seen["body"] == b'{"a":1' + STATIC_SPLICE.encode() + b"}"
    assert seen["content_length"] == str(len(seen["body"]))


def test_no_facts_no_change(stack: Stack) -> None:
    src = '{"messages":[{"content":"héllo"}]}'.encode()
    seen = echo(stack, src, {})
    assert seen["body"] == src
    assert seen["content_length"] == str(len(src))
