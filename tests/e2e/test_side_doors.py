"""No side door (issue 9): no spelling of a path lets a key use a model its ACL forbids.

Through the real Envoy with the rendered config, against two engines: the aiohttp mock and
a real ASGI engine (Starlette on uvicorn, as vLLM and SGLang serve), whose own decoding of
the path is what a side door would exploit. Every attempt names a forbidden model; it must
be refused and the engine must never see it.
"""

from __future__ import annotations

import gzip
import http.client
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devspoke.procs import Service
from devspoke.stack import Spoke
from testkit.spoke import client, start_spoke

AUTHZ_ONLY = True  # routing and the model checks happen at the Check: one metering source proves it

FORBIDDEN = ("mock-other", "no-such-model")  # 'narrow' may use only mock-model
ENGINE = Path(__file__).resolve().parents[1] / "engines" / "asgi_engine.py"

# Every spelling the issue found open, and their neighbours.
SPELLINGS = [
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/chat/completions?x=1", "/v1/chat/completions/", "/v1//chat/completions",
    "//v1/chat/completions", "/v1/chat/%63ompletions", "/v1/chat%2Fcompletions",
    "/v1/chat%2fcompletions", "/v1/x/../chat/completions", "/v1/x/%2e%2e/chat/completions",
    "/v1/./chat/completions", "/v1/chat/completions/.", "/%76%31/chat/completions",
    "/v1/ch%61t%2Fcompletions", "/v1\\chat\\completions", "/v1/chat%5Ccompletions",
    "/V1/CHAT/COMPLETIONS", "/v1/chat/completions%20", "/v1/chat/completions;x",
    "/v1/chat/completions%2F", "/v1/models/../chat/completions", "/../v1/chat/completions",
    "/v1/messages", "/v1/anything", "/v1/secret/x", "/v1/secret/..%2F..%2Fv1/messages",
    "/tokenize", "/tokenize/../v1/chat/completions", "/mock/stats",
]
METHODS = ["POST", "PUT", "PATCH", "GET", "DELETE"]


def asgi_engine(port: int, workdir: Path) -> Service:
    return Service("asgi-engine", [sys.executable, str(ENGINE), "--port", str(port)],
                   port, workdir)


@pytest.fixture(scope="module")
def asgi_spoke(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Spoke, dict]]:
    spoke, keys = start_spoke(tmp_path_factory.mktemp("asgi"), engine=asgi_engine, kafka=False)
    yield spoke, keys
    spoke.stop()


def raw(spoke: Spoke, method: str, path: str, key: str, body: bytes) -> tuple[int, bytes]:
    """One request exactly as spelled (httpx would normalise the path; http.client does not)."""
    conn = http.client.HTTPConnection("127.0.0.1", spoke.listen_port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={
            "authorization": f"Bearer {key}", "content-type": "application/json"})
        resp = conn.getresponse()
        try:
            return resp.status, resp.read()
        except http.client.IncompleteRead as exc:  # Envoy's own 400 for a malformed path,
            return resp.status, exc.partial  # sent as it closes the connection
        except ConnectionResetError:
            return resp.status, b""
    finally:
        conn.close()


def seen_by_asgi(spoke: Spoke) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = httpx.get(f"{spoke.engine_url}/__seen").json()
    return out


def mock_requests(spoke: Spoke) -> int:
    return int(httpx.get(f"{spoke.engine_url}/mock/stats").json()["requests"])


def body(model: str) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                         "prompt": "hi", "input": "hi", "max_tokens": 2})


def assert_refused(status: int, answer: bytes, method: str, path: str) -> None:
    assert status in (400, 403, 404), (method, path, status, answer[:200])


@pytest.mark.parametrize("path", SPELLINGS)
def test_no_spelling_reaches_the_asgi_engine_with_a_forbidden_model(
        asgi_spoke: tuple[Spoke, dict[str, str]], path: str) -> None:
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    for method in METHODS:
        for model in FORBIDDEN:
            status, answer = raw(spoke, method, path, keys["narrow"], body(model))
            assert_refused(status, answer, method, path)
    assert seen_by_asgi(spoke) == []


@pytest.mark.parametrize("path", SPELLINGS)
def test_no_spelling_reaches_the_mock_engine_with_a_forbidden_model(
        spoke: Spoke, keys: dict[str, str], path: str) -> None:
    before = mock_requests(spoke)
    for method in METHODS:
        status, answer = raw(spoke, method, path, keys["narrow"], body("mock-other"))
        assert_refused(status, answer, method, path)
    assert mock_requests(spoke) == before


def test_a_duplicate_model_key_is_judged_as_the_engine_reads_it(
        asgi_spoke: tuple[Spoke, dict[str, str]]) -> None:
    """JSON parsers keep the last of duplicate keys (Python's, orjson, the engine's)."""
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    for dup in (b'{"model":"mock-model","model":"mock-other","messages":[]}',
                b'{"model":"mock-model","mod\\u0065l":"mock-other","messages":[]}'):
        status, answer = raw(spoke, "POST", "/v1/chat/completions", keys["narrow"], dup)
        assert status == 403, answer
    assert seen_by_asgi(spoke) == []


def test_canonical_spellings_of_a_known_path_are_served_and_checked(
        asgi_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    for path in ("/v1/chat/%63ompletions", "/v1//chat/completions", "/v1/x/../chat/completions",
                 "/v1/chat%2Fcompletions"):
        status, answer = raw(spoke, "POST", path, keys["narrow"], body("mock-model"))
        assert status == 200, (path, answer)
    seen = seen_by_asgi(spoke)
    assert [s["path"] for s in seen] == ["/v1/chat/completions"] * 4  # one canonical path
    assert {s["model"] for s in seen} == {"mock-model"}


def test_unknown_paths_are_404_in_openais_shape_whatever_the_body(
        asgi_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    for path, payload in (("/v1/secret/x", b""), ("/v1/secret/x", body("mock-model")),
                          ("/v1/chat/completions/", body("mock-model"))):
        status, answer = raw(spoke, "POST", path, keys["good"], payload)
        assert status == 404
        err = orjson.loads(answer)["error"]
        assert err["code"] == "unknown_url" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client(spoke, keys["good"]).post("/secret/x", cast_to=object, body={})
    assert seen_by_asgi(spoke) == []


def test_a_passthrough_path_reaches_the_engine_but_a_model_in_its_body_is_checked(
        asgi_spoke: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    assert raw(spoke, "POST", "/tokenize", keys["narrow"], b'{"prompt": "hi"}')[0] == 200
    assert raw(spoke, "POST", "/tokenize", keys["narrow"], body("mock-model"))[0] == 200
    assert raw(spoke, "POST", "/tokenize", keys["narrow"], body("mock-other"))[0] == 403
    # JSON that orjson refuses and the engine's json.loads reads: a BOM, a NaN
    assert raw(spoke, "POST", "/tokenize", keys["narrow"],
               b"\xef\xbb\xbf" + body("mock-other"))[0] == 403
    assert raw(spoke, "POST", "/tokenize", keys["narrow"],
               body("mock-other")[:-1] + b',"temperature":NaN}')[0] == 403
    assert raw(spoke, "GET", "/tokenize", keys["narrow"], b"")[0] == 404  # POST only
    assert raw(spoke, "POST", "/tokenize", "sk-gw-nobody-x", b"{}")[0] == 401
    assert [s.get("model") for s in seen_by_asgi(spoke)] == [None, "mock-model"]


def test_a_passthrough_request_carries_no_forged_context_and_no_key(
        asgi_spoke: tuple[Spoke, dict[str, str]]) -> None:
    # no model in its body: the gateway has no model to set, and the client's must not stay
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    conn = http.client.HTTPConnection("127.0.0.1", spoke.listen_port, timeout=10)
    try:
        conn.request("POST", "/tokenize", body=b'{"prompt": "hi"}', headers={
            "authorization": f"Bearer {keys['narrow']}", "x-api-key": keys["good"],
            "x-gateway-model": "mock-other", "x-gateway-team": "evil",
            "x-gateway-key-id": "admin", "x-gateway-extra": "1",
            "x-gateway-inference-objective": "critical",
            "x-gateway-inference-fairness-id": "evil",
            # what a WSGI/CGI server behind would read as the same names
            "x_gateway_team": "evil", "x_gateway_key_id": "admin", "x_api_key": keys["good"]})
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    [seen] = seen_by_asgi(spoke)
    headers = seen["headers"]
    names = [k for k, _ in headers]
    assert "authorization" not in names and "x-api-key" not in names
    assert not [k for k in names if "_" in k], names  # Envoy drops them (DROP_HEADER)
    gateway = {k: v for k, v in headers if k.startswith("x-gateway-")}
    assert sorted(names.count(k) for k in gateway) == [1] * len(gateway), headers
    assert gateway.get("x-gateway-team") == "t1" and gateway.get("x-gateway-key-id") == "narrow"
    assert gateway.get("x-gateway-model", "") == "" and "x-gateway-extra" not in gateway
    assert "x-gateway-model" not in gateway  # none at all, not an empty one
    assert "x-gateway-inference-objective" not in gateway  # 'narrow' names none
    assert gateway.get("x-gateway-inference-fairness-id") == "t1"


def test_models_are_listed_for_the_keys_own_models(spoke: Spoke, keys: dict[str, str]) -> None:
    before = mock_requests(spoke)
    narrow = client(spoke, keys["narrow"])
    assert [m.id for m in narrow.models.list()] == ["mock-model"]
    assert narrow.models.retrieve("mock-model").id == "mock-model"
    with pytest.raises(openai.PermissionDeniedError):
        narrow.models.retrieve("mock-other")
    with pytest.raises(openai.NotFoundError):
        narrow.models.retrieve("no-such-model")
    good = client(spoke, keys["good"])
    assert sorted(m.id for m in good.models.list()) == ["mock-model", "mock-other"]
    assert mock_requests(spoke) == before  # answered by the gateway, from the policy


segment = st.sampled_from(["v1", "chat", "completions", "completion", "embeddings", "responses",
                           "messages", "models", "..", ".", "", "tokenize", "x", "%2e%2e",
                           "V1", "Chat", "mock-other"])


@st.composite
def spelled_paths(draw: st.DrawFn) -> str:
    """A path built from segments, then spelled hostile: percent-encoding, case, slashes."""
    segs = draw(st.lists(segment, min_size=1, max_size=6))
    path = "/" + "/".join(segs)
    chars = []
    for ch in path:
        how = draw(st.sampled_from(["keep"] * 6 + ["enc", "ENC", "case", "slash2", "bslash"]))
        if how == "enc" and ch != "%":
            chars.append(f"%{ord(ch):02x}")
        elif how == "ENC" and ch != "%":
            chars.append(f"%{ord(ch):02X}")
        elif how == "case":
            chars.append(ch.swapcase())
        elif how == "slash2" and ch == "/":
            chars.append("//")
        elif how == "bslash" and ch == "/":
            chars.append("\\")
        else:
            chars.append(ch)
    path = "".join(chars)
    if draw(st.booleans()):
        path += draw(st.sampled_from(["/", "?a=1", "?model=mock-model", ";x", "%20", "#f"]))
    return path


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=spelled_paths(), method=st.sampled_from(METHODS), model=st.sampled_from(FORBIDDEN))
def test_fuzzed_spellings_never_reach_the_engine_with_a_forbidden_model(
        asgi_spoke: tuple[Spoke, dict[str, str]], path: str, method: str, model: str) -> None:
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    status, answer = raw(spoke, method, path, keys["narrow"], body(model))
    assert status != 200 or b"mock-other" not in answer, (method, path, answer[:200])
    leaked = [s for s in seen_by_asgi(spoke) if s.get("model") in FORBIDDEN]
    assert not leaked, (method, path, leaked)


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP", "identity, gzip"])
def test_a_body_the_gateway_cannot_read_never_reaches_the_engine(
        asgi_spoke: tuple[Spoke, dict[str, str]], path: str, encoding: str) -> None:
    """A compressed body names no model the Check can read; an engine that decompresses
    (aiohttp's server does by default, cpp-httplib with zlib) would read the forbidden one.
    Refused with 415, on a pass-through as on an inference path."""
    spoke, keys = asgi_spoke
    seen_by_asgi(spoke)
    packed = gzip.compress(body("mock-other"))
    conn = http.client.HTTPConnection("127.0.0.1", spoke.listen_port, timeout=10)
    try:
        conn.request("POST", path, body=packed, headers={
            "authorization": f"Bearer {keys['narrow']}", "content-type": "application/json",
            "content-encoding": encoding})
        resp = conn.getresponse()
        status, answer = resp.status, resp.read()
    finally:
        conn.close()
    assert status == 415, (status, answer[:200])
    assert b"content-encoding" in answer.lower()
    assert seen_by_asgi(spoke) == []
    # identity is no encoding: served as usual
    assert raw_with(spoke, "/tokenize", keys["narrow"], {"content-encoding": "identity"}) == 200


def raw_with(spoke: Spoke, path: str, key: str, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", spoke.listen_port, timeout=10)
    try:
        conn.request("POST", path, body=b'{"prompt": "hi"}', headers={
            "authorization": f"Bearer {key}", "content-type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()
