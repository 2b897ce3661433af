"""ext_authz's HTTP door (gateway/server/check_http.py, gateway/server/authz_http.py): each
decision's answer as the HTTP/1.1 answer Envoy's http_service reads, and the door's own
server (a
stand-in authorizer: what is under test is the transport; the decisions go through a real
Envoy in the e2e suites, whose Envoy-fed spokes use this door)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from devspoke.procs import free_port
from gateway import envoy_contract as contract
from gateway.authz import answers
from gateway.authz.check import Check, answer
from gateway.authz.decision import Allow, Caller, Context, Decision, Reply
from gateway.authz.request import AuthzRequest
from gateway.limits.types import RateInfo
from gateway.metering import handoff
from gateway.metering.inject import Injected, Splice
from gateway.server import authz_http, check_http, http1
from gateway.token_weights import TokenWeights
from testkit.check_requests import HeldAuthorizer

SPLICE = Splice(1, 0, b'"stream_options":{"include_usage":true},', Injected(True, False))
REQ = AuthzRequest("r1", "POST", "/v1/chat/completions",
                   {"authorization": "Bearer sk", "x-gateway-team": "forged",
                    "x-gateway-key-id": "forged", "x-request-id": "r1"}, b"{}")
ALLOW = Allow(Context("r1", Caller("k1", "team-a", "m", "delivered"), True, 1200, True,
                      "/v1/chat/completions", 37, splice=SPLICE),
              RateInfo(req_limit=10, req_remaining=9, req_reset=0.1))


def http_answer(decision: Decision, req: AuthzRequest = REQ, traceparent: str = "") -> bytes:
    return check_http.encode(answer(decision, req, traceparent))


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers.pop("content-length")) == len(body)
    return int(lines[0].split()[1]), headers, body


def metadata_of(headers: dict[str, str]) -> dict[str, str]:
    """What Envoy's dynamic_metadata_from_headers files: the matching headers, as strings."""
    return {k: v for k, v in headers.items() if k in contract.METADATA_KEYS}


def test_an_allow_sets_upstream_headers_removes_credentials_and_hands_over_the_facts() -> None:
    for _ in range(2):  # the caller's part encoded, then as remembered
        status, headers, body = parse(http_answer(ALLOW, REQ, "00-t-s-01"))
        assert (status, body) == (200, b"")
        assert {k: headers[k] for k in contract.CONTEXT_HEADERS if k in headers} == {
            "x-gateway-request-id": "r1", "x-gateway-key-id": "k1", "x-gateway-team": "team-a",
            "x-gateway-model": "m", "x-gateway-inference-fairness-id": "team-a"}
        assert contract.OBJECTIVE_HEADER not in headers  # its key names none
        assert headers[contract.REMOVE_HEADER].split(",") == ["authorization", "x-api-key"]
        assert headers["x-ratelimit-limit-requests"] == "10"
        facts = handoff.read(metadata_of(headers))
        assert facts == handoff.read(
            handoff.allowed("r1", 1200, 37, "00-t-s-01", SPLICE)
            | handoff.caller("k1", "team-a", "m", "/v1/chat/completions", True, True, False,
                             False, False, "delivered"))
        assert facts.splice == SPLICE and facts.leased and facts.prompt_estimate == 37
        assert facts.cancelled == "delivered" and facts.stream


def test_forged_context_headers_not_ours_are_removed() -> None:
    req = AuthzRequest("r1", "POST", "/v1/chat/completions",
                       {"x-gateway-spoof": "1", "x-gateway-team": "t"}, b"")
    _, headers, _ = parse(http_answer(ALLOW, req))
    assert headers[contract.REMOVE_HEADER].split(",") == ["authorization", "x-api-key",
                                                          "x-gateway-spoof"]


def test_a_denial_carries_status_body_client_headers_and_its_metadata() -> None:
    deny = answers.unauthorized()
    status, headers, body = parse(http_answer(deny))
    assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
    assert headers["content-type"] == "application/json"
    assert handoff.read(metadata_of(headers)).denied_status == 401


def test_what_envoy_would_misread_travels_as_a_stand_in_status() -> None:
    """A 5xx from the door is its failure to Envoy, a 200 an allow: a 503 denial and the
    gateway's own answers go as WIRE_STATUS codes the bootstrap maps back."""
    status, headers, body = parse(http_answer(answers.unavailable("store down")))
    assert status == contract.WIRE_STATUS[503] and headers["retry-after"] == "1"
    assert metadata_of(headers)["status"] == "503" and body
    reply = Reply(200, b'{"object":"list","data":[]}', "k1", "team-a")
    status, headers, body = parse(http_answer(reply))
    assert status == contract.WIRE_STATUS[200] and body == reply.body
    assert "denied" not in metadata_of(headers)


@given(model=st.text(max_size=40))
def test_no_value_can_end_its_header_line(model: str) -> None:
    """The model of a denial is the client's: CR, LF or NUL in it must not start a header."""
    deny = dataclasses.replace(answers.model_not_found(model), model=model)
    raw = http_answer(deny)
    head = raw.partition(b"\r\n\r\n")[0]
    for line in head.split(b"\r\n")[1:]:
        assert b"\n" not in line and b"\r" not in line and b"\0" not in line
        assert b": " in line


def test_every_metadata_key_a_check_writes_is_one_the_door_sends() -> None:
    written = {*handoff.allowed("r", 1, 2, "tp", SPLICE),
               *handoff.caller("k", "t", "m", "/e", True, True, True, True, True),
               *handoff.caller("k", "t", "m", "/e", True, True, True, True, True,
                               weights=TokenWeights(output=4)),  # a model with token weights
               *handoff.denied("r", "rps", 429, "k", "t", "m", "/e", "tp"),
               *(head := handoff.denied("r", "unknown_url", 404, "k", "t", "", "/e")),
               *(handoff.metered(head) or head),  # a HEAD whose event the Check emitted
               *handoff.replied("r", "k", "t", "m", "/e", "tp")}
    assert written == set(contract.METADATA_KEYS)


@pytest.mark.parametrize("head, why", [
    (b"GET /x", "request line"),
    (b"POST /x HTTP/1.1\r\nbad header", "header line"),
    (b"POST /x HTTP/1.1\r\ntransfer-encoding: chunked", "chunked"),
    (b"POST /x HTTP/1.1\r\ncontent-length: -1", "content-length"),
])
def test_a_head_the_door_cannot_read_is_refused(head: bytes, why: str) -> None:
    with pytest.raises(http1.BadRequest):
        authz_http.parse_head(head)


def test_a_head_reads_as_a_checkrequest_would_carry_it() -> None:
    method, target, headers, length = authz_http.parse_head(
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Dup: 1\r\nx-dup: 2\r\n"
        b"content-length: 12")
    assert (method, target, length) == ("POST", "/v1/chat/completions?x=1", 12)
    assert headers == {"host": "a", "x-dup": "1,2", "content-length": "12"}


def request(rid: str, body: bytes = b'{"model":"m"}') -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nx-request-id: " + rid.encode()
            + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


@contextlib.asynccontextmanager
async def door(authorizer: HeldAuthorizer):  # type: ignore[no-untyped-def]
    port = free_port()
    server = await authz_http.serve(Check(authorizer),  # type: ignore[arg-type]
                                    "127.0.0.1", port, max_body=1024)
    try:
        yield await asyncio.open_connection("127.0.0.1", port)
    finally:
        server.close()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status, headers, _ = parse(head)  # content-length 0 for an allow
    return status, headers, b""


async def test_requests_on_one_connection_are_answered_in_order() -> None:
    authorizer = HeldAuthorizer(ALLOW)
    authorizer.release.set()
    async with door(authorizer) as (reader, writer):
        writer.write(request("a") + request("b"))  # both at once: read in order
        first, second = await read_answer(reader), await read_answer(reader)
        assert first[0] == second[0] == 200
        writer.close()


async def test_a_decision_that_waits_holds_the_next_request_until_it_is_answered() -> None:
    """A Check that never waits is answered at once, one that waits by a Task; the requests
    behind it wait for its answer (one connection answers in its requests' order)."""
    authorizer = HeldAuthorizer(ALLOW)
    async with door(authorizer) as (reader, writer):
        writer.write(request("a") + request("b"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.1)
        authorizer.release.set()  # the first ends its wait; the second does not wait
        first, second = await read_answer(reader), await read_answer(reader)
        assert first[0] == second[0] == 200
        writer.close()


async def test_a_connection_closed_mid_decision_undoes_the_admission() -> None:
    """Envoy closes the connection when it gives up on the Check (client gone, timeout)."""
    authorizer = HeldAuthorizer(ALLOW)
    async with door(authorizer) as (_, writer):
        writer.write(request("gone"))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        for _ in range(50):
            if authorizer.abandoned:
                break
            await asyncio.sleep(0.02)
    assert authorizer.abandoned == ["gone"]


@pytest.mark.parametrize("raw", [b"nonsense\r\n\r\n",
                                 request("big", b"x" * 2000)])
async def test_what_the_door_cannot_take_closes_without_a_decision(raw: bytes) -> None:
    """A 5xx, which Envoy answers with its status_on_error 503 (fail closed); a body over
    the limit a 413."""
    authorizer = HeldAuthorizer(ALLOW)
    authorizer.release.set()
    async with door(authorizer) as (reader, writer):
        writer.write(raw)
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.split(b" ")[1] in (b"500", b"413")
        assert await reader.read() == b""


async def test_the_door_counts_the_checks_waiting_on_every_connection() -> None:
    """authz_http.waiting(): the records batches' gauge of load (records_service); a Check
    answered, or abandoned with its connection, no longer counts."""
    authorizer = HeldAuthorizer(ALLOW)
    async with door(authorizer) as (reader, writer):
        other = await asyncio.open_connection("127.0.0.1", writer.get_extra_info("peername")[1])
        writer.write(request("a"))
        other[1].write(request("b"))
        for _ in range(50):
            if authz_http.waiting() == 2:
                break
            await asyncio.sleep(0.01)
        assert authz_http.waiting() == 2
        other[1].close()  # "b" abandoned
        for _ in range(50):
            if authz_http.waiting() == 1:
                break
            await asyncio.sleep(0.01)
        assert authz_http.waiting() == 1
        authorizer.release.set()
        assert (await read_answer(reader))[0] == 200
        await asyncio.sleep(0)
        assert authz_http.waiting() == 0
        writer.close()
