"""A prompt's size in tokens, estimated on the request path without a tokenizer: what the
Check reserves before the engine reports the real count (gateway/authz/request.py reads it
into the body's facts). Text is ~4 characters a token; images, documents, audio and video
count by what they cost a model, not by the size of their base64."""

from __future__ import annotations

import binascii
from typing import Any

import orjson

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
    `image_url`, `input_image`, vLLM's `image_embeds`) counts IMAGE_TOKENS, whatever its data
    or URL; a document part (`document`, `file`, `input_file`) DOCUMENT_TOKENS, whatever its
    data, URL or file id;
    an audio part (`input_audio`, `audio_url`) its duration's tokens (`_audio_tokens`), vLLM's
    `audio_embeds` an audio URL's; a video part (`video_url`) VIDEO_TOKENS."""
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
