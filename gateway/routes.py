"""Which requests the gateway knows: decided on the path the engine will route on.

No side door (DESIGN §6): the sidecar must judge a request by what the *engine* will make
of it, not by how the client spelled it. Engines behind uvicorn/Starlette percent-decode
the path before routing, so `/v1/chat/%63ompletions` is a chat completion to them. Envoy
is configured to hand over one canonical path (gateway/envoyconf/bootstrap.py), and the sidecar
canonicalizes again here, so an Envoy without those settings (a managed gateway) or the
embedded mode is no weaker.

The rule, in order:
* a known inference endpoint (POST) needs a JSON body naming a model;
* `GET /v1/models` and `GET /v1/models/{id}` are answered by the gateway itself, from the
  policy, for the key's own models;
* a path the policy lists as a pass-through goes to the engine; if its body names a
  model, the model checks still apply;
* anything else is refused (404), whatever its body.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from enum import Enum
from urllib.parse import unquote

from gateway.endpoints import ENDPOINTS, MODEL_PREFIX, MODELS_PATH
from gateway.errors import PathError

# Endpoints whose POST body must be JSON naming a model (DESIGN §6): gateway/endpoints.py.
INFERENCE_PATHS = frozenset(ENDPOINTS)
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f]")


class Kind(Enum):
    INFERENCE = "inference"  # a model, the three tiers, a token reservation, an event
    MODELS = "models"  # answered by the gateway: the key's own models
    MODEL = "model"  # answered by the gateway: one model, if the key may use it
    PASSTHROUGH = "passthrough"  # the policy lets it through to the engine
    UNKNOWN = "unknown"  # refused: 404


@dataclass(frozen=True, slots=True)
class Route:
    kind: Kind
    path: str  # canonical
    model: str = ""  # the id asked for by GET /v1/models/{id}


def canonical_path(raw: str) -> str:
    """The path as an engine routes it: query and fragment cut, percent-encoding decoded
    (once, as uvicorn does), backslashes as slashes (as Envoy's normalize_path does),
    repeated slashes merged and dot segments resolved (RFC 3986 §5.2.4).

    Raises PathError for a path no engine should see: not absolute, invalid UTF-8 once
    decoded, or control characters.
    """
    path = raw.split("?", 1)[0].split("#", 1)[0]
    if path in INFERENCE_PATHS:  # the common case, canonical already
        return path
    if not path.startswith("/"):
        raise PathError(f"the request path must start with '/': {raw[:80]!r}")
    try:
        path = unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise PathError("the request path is not valid UTF-8 once decoded") from None
    if _FORBIDDEN.search(path):
        raise PathError("the request path contains control characters")
    out: list[str] = []
    segments = path.replace("\\", "/").split("/")
    for seg in segments[1:-1]:
        if seg == "..":
            if out:
                out.pop()
        elif seg not in ("", "."):
            out.append(seg)
    last = segments[-1] if len(segments) > 1 else ""
    if last == "..":
        if out:
            out.pop()
        last = ""
    elif last == ".":
        last = ""
    return "/" + "/".join([*out, last]) if out else "/" + last


@dataclass(frozen=True, slots=True)
class PassThrough:
    """A path (glob over the canonical path; `*` spans segments) and the methods allowed."""

    pattern: str
    methods: frozenset[str]

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and fnmatch.fnmatchcase(path, self.pattern)


def route(method: str, path: str, passthrough: tuple[PassThrough, ...] = ()) -> Route:
    """Classify a request by its canonical `path` (see canonical_path)."""
    if path in INFERENCE_PATHS:
        if method == "POST":
            return Route(Kind.INFERENCE, path)
    elif method == "GET":
        if path == MODELS_PATH:
            return Route(Kind.MODELS, path)
        if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
            return Route(Kind.MODEL, path, model=path[len(MODEL_PREFIX):])
    for p in passthrough:
        if p.matches(method, path):
            return Route(Kind.PASSTHROUGH, path)
    return Route(Kind.UNKNOWN, path)
