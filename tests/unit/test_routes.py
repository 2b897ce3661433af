"""The canonical path and the route rules (gateway/routes.py), without servers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import PathError, PolicyError
from gateway.policy import loader
from gateway.routes import Kind, PassThrough, canonical_path, route

# What the real Envoy 1.40 forwards with normalize_path, merge_slashes and
# UNESCAPE_AND_FORWARD (probed against the binary); the sidecar must agree on each.
ENVOY_FORWARDS = {
    "/v1//chat/completions": "/v1/chat/completions",
    "/v1/chat/%63ompletions": "/v1/chat/completions",
    "/v1/chat%2Fcompletions": "/v1/chat/completions",
    "/v1/x/../chat/completions": "/v1/chat/completions",
    "/v1/x/%2e%2e/chat/completions": "/v1/chat/completions",
    "/v1/./chat/completions": "/v1/chat/completions",
    "/v1/chat%5Ccompletions": "/v1/chat/completions",
    "/v1\\chat\\completions": "/v1/chat/completions",
    "/%76%31/chat/completions": "/v1/chat/completions",
    "//v1/chat/completions": "/v1/chat/completions",
    "/../v1/chat/completions": "/v1/chat/completions",
    "/v1/chat/completions/": "/v1/chat/completions/",
    "/v1/chat/completions/.": "/v1/chat/completions/",
    "/v1/chat/completions%2F": "/v1/chat/completions/",
    "/V1/CHAT/completions": "/V1/CHAT/completions",
    "/v1/models/org%2Fname": "/v1/models/org/name",
    "/": "/",
}


@pytest.mark.parametrize(("raw", "canonical"), ENVOY_FORWARDS.items())
def test_canonical_path_agrees_with_envoy(raw: str, canonical: str) -> None:
    assert canonical_path(raw) == canonical


def test_canonical_path_decodes_what_envoy_leaves_as_the_engine_would() -> None:
    assert canonical_path("/v1/chat/completions%20") == "/v1/chat/completions "
    assert canonical_path("/v1/a?x=/../b") == "/v1/a"  # the query is not the path
    assert canonical_path("/v1/%252e%252e/x") == "/v1/%2e%2e/x"  # decoded once, as uvicorn


@pytest.mark.parametrize("raw", ["v1/chat", "", "/v1/%00", "/v1/%ff", "/v1/a%0ab", "/a\x7f"])
def test_paths_no_engine_should_see_are_errors(raw: str) -> None:
    with pytest.raises(PathError):
        canonical_path(raw)


@given(st.text(max_size=60))
def test_canonical_path_is_absolute_and_clean_or_an_error(raw: str) -> None:
    try:
        path = canonical_path(raw)
    except PathError:
        return
    assert path.startswith("/")
    assert "//" not in path
    assert "/../" not in path + "/" and "/./" not in path + "/"


def test_routes() -> None:
    tok = (PassThrough("/tokenize", frozenset({"POST"})), PassThrough("/v1/files/*",
                                                                       frozenset({"GET"})))
    assert route("POST", "/v1/chat/completions").kind is Kind.INFERENCE
    assert route("GET", "/v1/chat/completions").kind is Kind.UNKNOWN
    assert route("GET", "/v1/models").kind is Kind.MODELS
    assert route("POST", "/v1/models").kind is Kind.UNKNOWN
    r = route("GET", "/v1/models/org/name")
    assert (r.kind, r.model) == (Kind.MODEL, "org/name")
    assert route("GET", "/v1/models/").kind is Kind.UNKNOWN
    assert route("POST", "/tokenize", tok).kind is Kind.PASSTHROUGH
    assert route("GET", "/tokenize", tok).kind is Kind.UNKNOWN
    assert route("GET", "/v1/files/a/b", tok).kind is Kind.PASSTHROUGH
    assert route("POST", "/v1/chat/completions/", tok).kind is Kind.UNKNOWN
    assert route("POST", "/v1/messages").kind is Kind.INFERENCE
    assert route("POST", "/v1/messages/count_tokens").kind is Kind.INFERENCE
    assert route("POST", "/v1/messages/batches").kind is Kind.UNKNOWN


def test_passthrough_paths_in_the_policy_must_be_canonical() -> None:
    base = "models: {m: {}}\npassthrough:\n"
    pol = loader.load(base + "  - {path: /tokenize, methods: [POST]}\n  - {path: /health}\n", 1)
    assert [(p.pattern, sorted(p.methods)) for p in pol.passthrough] == [
        ("/tokenize", ["POST"]), ("/health", ["GET"])]
    for bad in ("/v1//x", "/v1/../x", "/v1/%78", "tokenize", "/x?y=1"):
        with pytest.raises(PolicyError, match=r"passthrough\.0\.path"):
            loader.load(base + f"  - {{path: '{bad}'}}\n", 1)
    with pytest.raises(PolicyError, match=r"passthrough\.0\.methods"):
        loader.load(base + "  - {path: /x, methods: [FETCH]}\n", 1)
