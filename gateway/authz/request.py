"""The facts of one request, decoupled from Envoy's CheckRequest, and how to read them."""

from __future__ import annotations

import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

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
        if not generates:
            return self.prompt_tokens
        bound = default_completion if self.max_tokens is None else self.max_tokens  # 0 too
        return self.prompt_tokens + min(bound * self.sequences, cap)


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


PROMPT_FIELDS = ("messages", "prompt", "input", "instructions", "system")
# An image in a prompt costs the model a number of tokens set by its pixels, not by the
# size of its base64: Anthropic's models ~1,600 at most (an image is resized to ~1.15 MP),
# OpenAI's up to ~1,100, open vision models 576 (LLaVA) to a few thousand at common sizes.
# Counted as text, a 200 KB JPEG was ~67,000 tokens, refused as "can never pass" by a
# window of 50,000; a URL image counted nothing. Each image part counts this instead.
IMAGE_TOKENS = 1600
# Messages, chat, Responses; vLLM's precomputed `image_embeds` (a base64 tensor: counted as
# text, one LLaVA image's 576 x 4096 float16 was ~1.2 million tokens)
IMAGE_PARTS = frozenset(("image", "image_url", "input_image", "image_embeds"))
# A document (a PDF) is read as each page's text plus each page as an image: Anthropic
# documents 1,500-3,000 tokens of text a page, plus the page's image. Its page count is inside
# the base64, which the request path does not decode, so a document part counts one page at
# the top of that text range, not its base64 as text
# (a 1 MB PDF was ~330,000 tokens, refused as "can never pass" by most windows). A document
# of many pages is reserved less than it uses, and settled at what the engine reports. An
# Anthropic document whose source is `text` or `content` is text, and counted as text.
DOCUMENT_TOKENS = 3000
DOCUMENT_PARTS = frozenset(("document", "file", "input_file"))  # Messages, chat, Responses
DOCUMENT_TEXT = ("title", "context")  # an Anthropic document's own text, beside its source


# Audio costs a model tokens per second of sound, not per byte of its base64: OpenAI's
# gpt-4o audio ~10 a second; open models behind vLLM 6.25 (Gemma 3n, Ultravox) to 12.5
# (Phi-4-multimodal, Voxtral) and 25 (Qwen2-Audio, Qwen2.5-Omni: Whisper's encoder, 50
# frames a second, pooled 2x); Gemini documents 32. Counted as text, one minute of 16 kHz
# WAV (~2.5 MB of base64) was ~640,000 tokens, refused as "can never pass" by any window.
# An audio part counts its duration times AUDIO_TOKENS_PER_SECOND, the top of the models
# served behind the gateway's engines; the duration is its decoded size (base64 x 3/4)
# over the byte rate that a WAV header states, else an assumed low one (so a longer
# guess, never a shorter). Settlement replaces the estimate with what the engine reports.
AUDIO_TOKENS_PER_SECOND = 25
# A WAV whose header cannot be read: 8 kHz 16-bit mono (telephone), the lowest PCM rate in
# common use (a 48 kHz stereo file is reserved 12x its length: high, but not absurd).
WAV_BYTES_PER_SECOND = 16_000
# Anything else (mp3, and the flac/ogg vLLM also decodes): 32 kbps, the low end of speech
# MP3 (a 128 kbps file is reserved 4x its length).
COMPRESSED_BYTES_PER_SECOND = 4_000
# A clip behind a URL cannot be sized without fetching it: one 30 s window, what a
# Whisper-encoder model takes in at once (Qwen2-Audio truncates its input there).
AUDIO_URL_TOKENS = 30 * AUDIO_TOKENS_PER_SECOND
# chat and Responses; vLLM's URL form and its precomputed `audio_embeds` (a tensor: unsized,
# counted as a URL's clip)
AUDIO_PARTS = frozenset(("input_audio", "audio_url", "audio_embeds"))
# A video is sampled into frames, each an image: vLLM's loader takes 32 frames by default,
# LLaVA-OneVision spends 196 tokens a frame (6,272), Qwen2-VL a few hundred per frame pair
# (up to ~12,000-24,000 at its caps). Its frame count and size are inside the file, which
# the request path does not decode: each video part counts this, whatever its data or URL.
VIDEO_TOKENS = 6400
VIDEO_PARTS = frozenset(("video_url",))  # vLLM, SGLang
_DATA_URL_HEAD = 256  # a data: URL's "data:audio/wav;base64," is found in its first bytes


def _audio_tokens(part: dict[str, Any], kind: str) -> int:
    """An audio part's tokens: its duration (from its base64's length) times the rate, or
    AUDIO_URL_TOKENS for a URL. A malformed part counts what can be read of it, never
    raises (the engine answers its own 400)."""
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            return AUDIO_URL_TOKENS
        data, fmt = audio.get("data"), audio.get("format")
    else:
        url = part.get("audio_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url.startswith("data:"):
            return AUDIO_URL_TOKENS
        data, fmt = url, None
    if not isinstance(data, str):
        return AUDIO_URL_TOKENS
    if data.startswith("data:"):  # a data: URL (a few clients send one as input_audio.data)
        comma = data.find(",", 0, _DATA_URL_HEAD)
        if comma < 0:
            return AUDIO_URL_TOKENS
        fmt = fmt or data[5:comma]  # "audio/wav;base64": only "wav" is looked for
        data = data[comma + 1:]
    rate = _wav_byte_rate(data)
    if rate is None:
        wav = isinstance(fmt, str) and "wav" in fmt
        rate = WAV_BYTES_PER_SECOND if wav else COMPRESSED_BYTES_PER_SECOND
    return -(-len(data) * 3 * AUDIO_TOKENS_PER_SECOND // (4 * rate))  # ceil


def _wav_byte_rate(b64: str) -> int | None:
    """The byte rate a WAV's RIFF header states (its `fmt ` chunk, after any chunk before
    it within the first 192 bytes), bounded to 8 kHz 8-bit mono .. 48 kHz 32-bit stereo;
    None if the data is not a WAV or not readable. Decodes only those first bytes."""
    try:
        head = binascii.a2b_base64(b64[:256])
    except (binascii.Error, ValueError):
        return None
    if len(head) < 36 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    at = 12
    while at + 16 <= len(head):
        size = int.from_bytes(head[at + 4:at + 8], "little")
        if head[at:at + 4] == b"fmt ":
            if at + 20 > len(head) or size < 16:
                return None
            rate = int.from_bytes(head[at + 16:at + 20], "little")  # nAvgBytesPerSec
            return min(max(rate, 8_000), 384_000)
        at += 8 + size + (size & 1)
    return None


# A part's `type` -> how it is counted (`_media_tokens`); any other type is walked as text
_MEDIA: dict[str, str] = {
    **dict.fromkeys(IMAGE_PARTS, "image"), **dict.fromkeys(DOCUMENT_PARTS, "document"),
    **dict.fromkeys(AUDIO_PARTS, "audio"), **dict.fromkeys(VIDEO_PARTS, "video")}


def _media_tokens(part: dict[str, Any], kind: str, media: str, stack: list[Any]) -> int:
    """The tokens of an image, document, audio or video part; what of it is text (a
    document's title and context, a document of text) goes on `stack` to be walked."""
    if media == "image":
        return IMAGE_TOKENS
    if media == "audio":
        return _audio_tokens(part, kind)
    if media == "video":
        return VIDEO_TOKENS
    if _text_document(part):
        stack.extend(part.values())
        return 0
    stack.extend(part.get(f) for f in DOCUMENT_TEXT)
    return DOCUMENT_TOKENS


def _text_document(part: dict[str, Any]) -> bool:
    """An Anthropic document whose source is plain text or content blocks, not a file."""
    source = part.get("source")
    return isinstance(source, dict) and source.get("type") in ("text", "content")


def estimate_prompt_tokens(data: dict[str, Any]) -> int:
    """~4 characters a token over the prompt's text, plus a few tokens per message: what
    OpenAI's own rule of thumb gives, without a tokenizer on the request path.

    `tools` are prompt too (Anthropic bills their definitions as input; an OpenAI-compatible
    engine renders them into the chat template): ~4 characters a token of their whole JSON,
    since the schema's keys are rendered as much as its values. An image part (`image`,
    `image_url`, `input_image`) counts IMAGE_TOKENS, whatever its data or URL; a document part
    (`document`, `file`, `input_file`) DOCUMENT_TOKENS, whatever its data, URL or file id;
    an audio part (`input_audio`, `audio_url`) its duration's tokens (`_audio_tokens`); a
    video part (`video_url`) VIDEO_TOKENS."""
    chars = 0
    parts = 0
    stack: list[Any] = [data.get(f) for f in PROMPT_FIELDS]
    tools = data.get("tools")
    if isinstance(tools, list) and tools:
        try:
            chars += len(orjson.dumps(tools))
        except orjson.JSONEncodeError:  # past orjson's depth, a lone surrogate: walk it
            stack.append(tools)
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, list):
            parts += len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            kind = v.get("type")
            # text (one lookup, whatever its type), or a type that is no string (a list:
            # unhashable): walked as text
            if not isinstance(kind, str) or (media := _MEDIA.get(kind)) is None:
                stack.extend(v.values())
            else:
                chars += 4 * _media_tokens(v, kind, media, stack)
        elif isinstance(v, int) and not isinstance(v, bool):
            chars += 4  # a token id (completions accept token arrays)
    return chars // 4 + 3 * parts + 1
