"""The facts of one request, decoupled from Envoy's CheckRequest, and how to read them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.authz.prompt_estimate import estimate_prompt_tokens
from gateway.endpoints import BEST_OF, N
from gateway.errors import BodyError


@dataclass(frozen=True, slots=True)
class AuthzRequest:
    request_id: str
    method: str
    path: str  # as Envoy sent it, without the query string (routes.canonical_path reads it)
    headers: dict[str, str]  # lower-case names, as Envoy sends them
    body: bytes


@dataclass(frozen=True, slots=True)
class BodyFacts:
    model: str | None
    stream: bool = False
    max_tokens: int | None = None
    body_bytes: int = 0
    prompt_tokens: int = 0  # estimate: ~4 characters a token of the prompt's text
    stream_options: bool = False  # the client sent a stream_options object
    include_usage: bool = False  # ... asking for the usage chunk
    continuous_usage: bool = False  # ... asking for vLLM's continuous usage stats
    sequences: int = 1  # completions the engine generates, each up to max_tokens (sequences())
    # a `stream_options` member of any value (null too), however its key is spelled
    # (`"stream_opt\\u0069ons"`): inject.plan must then find it, not add a second one
    options_member: bool = False

    def reserve(self, default_completion: int, cap: int, generates: bool = True) -> int:
        """Tokens to reserve: the prompt estimate plus the completion bound, which is the
        per-sequence bound (max_tokens, else the default) times the sequences the engine
        generates (`n`, `best_of`, a list of prompts: see `sequences`).

        `cap` (GATEWAY_RESERVE_CAP_TOKENS) bounds that whole completion side, not each
        sequence: it is documented as the cap on the completion side of one reservation,
        i.e. the most one request holds of a budget while in flight, and it is what keeps a
        request that merely asks for a large bound from being refused as impossible under a
        limit larger than prompt + cap. Per sequence, one body could hold 128 x 20 x
        (prompts) times it. Up to the cap, a burst of n > 1 requests is reserved for all
        it can generate; past it, the overshoot is what a single max_tokens above the cap
        already allows, until settlement replaces the reservation with the billed count.

        Only the completion side is capped: the prompt is sent whatever max_tokens says, so
        a huge prompt reserves (and must fit) all of itself."""
        return self.prompt_tokens + self.completion_bound(default_completion, cap, generates)

    def completion_bound(self, default_completion: int, cap: int, generates: bool = True
                         ) -> int:
        """The completion side of `reserve` alone (0 where nothing is generated): what a
        model's output weight multiplies (gateway/token_weights.py)."""
        if not generates:
            return 0
        bound = default_completion if self.max_tokens is None else self.max_tokens  # 0 too
        return min(bound * self.sequences, cap)


# Every API's completion cap, for a body on a path no endpoint entry describes (a
# pass-through): the first given.
CAPS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# ... and every field that multiplies it (gateway/endpoints.py): `n` and `best_of`.
FANOUT = (N, BEST_OF)


def api_key(headers: dict[str, str]) -> str | None:
    """`Authorization: Bearer <key>` (scheme case-insensitive) or `x-api-key: <key>`.

    A header that Envoy comma-merged from duplicates, or any whitespace inside the key,
    yields no key at all rather than a guess.
    """
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.strip().partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token and _plain(token):
            return token
        return None
    key = headers.get("x-api-key")
    if key is not None:
        key = key.strip()
        if key and _plain(key):
            return key
    return None


def _plain(token: str) -> bool:
    return len(token) <= 512 and token.isprintable() and " " not in token and "," not in token


# pydantic-core's integer text: leading zeros may carry underscores ("0__1" is 1), other
# digits single ones between them ("1_000", not "1__0"), then an optional ".0..."
_INT_TEXT = re.compile(r"([+-]?(?:(?:0[0_]*)?[1-9][0-9]*(?:_[0-9]+)*|0(?:[0_]*0)?))(?:\.0+)?",
                       re.ASCII)
# What pydantic-core (Rust's str::trim) trims around a number: Unicode's White_Space, which
# is not str.strip()'s set (that one adds U+001C..U+001F)
_WHITE_SPACE = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
                "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def lax_int(v: Any) -> int | None:
    """A JSON value read as an integer the way pydantic v2 reads an `int` in lax mode (what
    vLLM and SGLang do with `max_tokens`, `n`...): an integer, a float with no fraction
    (10.0), a string of one ("10", " 10 ", "+5", "1_000", "10.0"), true and false as 1 and
    0; None for what pydantic refuses. tests/unit/test_lax_int.py holds it to pydantic's
    own TypeAdapter(int). (Read strictly, `"max_tokens": 5000.0` reserved the default and
    Messages answered it 400, while the engine generates up to 5,000.)"""
    t = type(v)
    if t is int:
        return v
    if t is bool:
        return int(v)
    if t is float:
        return int(v) if v.is_integer() and abs(v) < 2**63 else None
    if t is str and len(v) < 64 and (m := _INT_TEXT.fullmatch(v.strip(_WHITE_SPACE))):
        return int(m.group(1).replace("_", ""))
    return None


def _int(v: Any) -> int | None:
    """A non-negative lax_int (a count or a bound), else None."""
    n = lax_int(v)
    return n if n is not None and n >= 0 else None


def parse_body(body: bytes, requires_max_tokens: bool = False,
               caps: tuple[str, ...] = CAPS, fanout: tuple[tuple[str, int], ...] = (),
               list_prompts: bool = False) -> BodyFacts:
    """Read what admission needs from an inference body; raise BodyError if it is not usable.

    `requires_max_tokens`: the API itself rejects a body without it (Anthropic's Messages),
    so the gateway says so before the engine does, and the reservation is then exact.
    `caps`: the fields that bound the completion on this endpoint, the first given wins
    (gateway/endpoints.py). `fanout` and `list_prompts`: how many sequences the engine
    generates (`sequences`).
    """
    if not body:
        raise BodyError("request body is empty; expected a JSON object with a 'model'")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BodyError("request body must be a JSON object")
    facts = _facts(data, len(body), caps, fanout, list_prompts)
    if requires_max_tokens and facts.max_tokens is None:
        raise BodyError("max_tokens: Field required (a non-negative integer)")
    return facts


def named_model(body: bytes) -> BodyFacts | None:
    """A pass-through body's facts if it is a JSON object with a `model`, else None.

    A body that names a model passes the model checks on any path (no side door); one
    that is not JSON (a file upload, say) names none. A `model` that is there but not a
    non-empty string is refused (BodyError) rather than ignored.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = _lenient(body)
    if not isinstance(data, dict) or "model" not in data:
        return None
    return _facts(data, len(body), CAPS, FANOUT, True)


def _lenient(body: bytes) -> Any:
    """The body as an engine behind FastAPI/Starlette reads it (the stdlib's json.loads),
    when orjson, stricter, refused it: a UTF-8 BOM, UTF-16/32, NaN or Infinity, a lone
    surrogate escape. Such a body names its model to the engine all the same, so it must
    not pass as one that names none. None when the stdlib refuses it too."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(data, dict) and isinstance(model := data.get("model"), str):
        try:
            model.encode()
        except UnicodeEncodeError:  # a lone surrogate: no answer could name it
            raise BodyError("'model' is not valid UTF-8") from None
    return data


# The strings pydantic's lax `bool` reads (case-insensitively, nothing stripped): what vLLM
# and SGLang, which validate requests with pydantic in lax mode, accept for a flag.
_TRUE_WORDS = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE_WORDS = frozenset(("0", "off", "f", "false", "n", "no"))


def lax_bool(v: Any) -> bool | None:
    """A JSON value read as a flag the way pydantic v2 reads a `bool` in lax mode (what
    vLLM and SGLang do with `stream`, `stream_options.include_usage`...): true and false;
    the numbers 1 and 0 (1.0 and 0.0 too); and, whatever their case, the strings "1",
    "on", "t", "true", "y", "yes" and "0", "off", "f", "false", "n", "no". None for what
    pydantic refuses (a 400 from those engines): any other number or string (" true",
    "1.0"), null, a list, an object. tests/unit/test_lax_bool.py holds it to pydantic's
    own TypeAdapter(bool)."""
    if v is True or v is False:
        return v
    t = type(v)
    if t is str:
        if len(v) <= 5 and v.isascii():  # only ASCII lower-cases into a word
            w = v.lower()
            if w in _TRUE_WORDS:
                return True
            if w in _FALSE_WORDS:
                return False
        return None
    if t is int or t is float:
        if v == 1:
            return True
        if v == 0:
            return False
    return None


def _flag(v: Any) -> bool:
    """A flag the engine reads as true (lax_bool); one it would refuse reads as false: the
    body passes to the engine as it is, and the engine answers its 400 (see README)."""
    return lax_bool(v) is True


def _facts(data: dict[str, Any], size: int, caps: tuple[str, ...] = CAPS,
           fanout: tuple[tuple[str, int], ...] = (), list_prompts: bool = False) -> BodyFacts:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BodyError("'model' is required and must be a non-empty string")
    # The first cap the body gives, 0 included (a falsy `or` chain read 0 as no cap, and
    # told a Messages body with max_tokens 0 that the field was missing).
    max_tokens = None
    for cap in caps:
        if (max_tokens := _int(data.get(cap))) is not None:
            break
    prompt = estimate_prompt_tokens(data)
    seqs = sequences(data, fanout, list_prompts)
    # `stream` as the engine reads it: "stream": "true" streams on vLLM and SGLang, so it
    # is reserved, injected and metered as a stream (the body itself is left as it is).
    stream = _flag(data.get("stream"))
    opts = data.get("stream_options")
    if not isinstance(opts, dict):
        return BodyFacts(model, stream, max_tokens, size, prompt, sequences=seqs,
                         options_member=opts is not None or "stream_options" in data)
    return BodyFacts(
        model, stream, max_tokens, size, prompt,
        stream_options=True, options_member=True,
        include_usage=_flag(opts.get("include_usage")),
        continuous_usage=_flag(opts.get("continuous_usage_stats")),
        sequences=seqs,
    )


def sequences(data: dict[str, Any], fanout: tuple[tuple[str, int], ...],
              list_prompts: bool) -> int:
    """How many sequences the engine generates for this body: the largest of the `fanout`
    fields (chat: `n`; completions: `n` and `best_of`, best_of >= n), times the prompts of
    a completions `prompt` that is a list of strings or of token arrays (each prompt gets
    them all; a flat list of token ids is one prompt). Read as the engine reads it
    (lax_int): a value it refuses reads as 1 (the engine answers 400), none counts above
    what the API accepts. A few dict lookups: this runs on every request."""
    most = 1
    for field, api_max in fanout:
        v = data.get(field)
        if v is not None and (v := lax_int(v)) is not None and v > most:  # "n": "4" is 4
            most = v if v <= api_max else api_max
    if list_prompts:
        p = data.get("prompt")
        if type(p) is list and p and isinstance(p[0], (str, list)):
            most *= len(p)
    return most
