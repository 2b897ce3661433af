"""The prompt estimate used for reservations and for cut streams' usage."""

import base64
import io
import wave
from typing import Any

from gateway.authz.prompt_estimate import estimate_prompt_tokens
from gateway.authz.request import parse_body


def test_counts_text_not_json_overhead() -> None:
    text = "word " * 80  # 400 characters
    chat = {"model": "m", "max_tokens": 5, "temperature": 0.2,
            "messages": [{"role": "user", "content": text}]}
    est = estimate_prompt_tokens(chat)
    assert 100 <= est <= 110
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    assert abs(estimate_prompt_tokens(parts) - est) <= 5
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4]}) >= 4  # token ids
    assert estimate_prompt_tokens({"input": ["a" * 40, "b" * 40]}) >= 20
    assert estimate_prompt_tokens({"model": "m"}) == 1


def test_body_facts_carry_it() -> None:
    facts = parse_body(b'{"model":"m","messages":[{"role":"user","content":"hello there"}]}')
    assert 3 <= facts.prompt_tokens <= 10


# A tool definition as the Messages API and chat completions take it: the engine renders the
# whole schema into the prompt (names and keys included), and bills it as input.
TOOL = {"name": "get_weather", "description": "Get the current weather in a given location. " * 4,
        "input_schema": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"]}}


def test_tools_are_prompt() -> None:
    """Tool definitions are input tokens (Anthropic bills them, and its tool-use system
    prompt; an OpenAI-compatible engine renders them into the chat template): the estimate
    counts them, at ~4 characters a token of their JSON, so a request whose prompt is mostly
    tools reserves them rather than 1 token."""
    import orjson
    bare = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    tools = [TOOL] * 20
    size = len(orjson.dumps(tools)) // 4
    messages = estimate_prompt_tokens({**bare, "tools": tools})
    assert size <= messages - estimate_prompt_tokens(bare) <= size + 3 * 20 + 2
    chat = [{"type": "function", "function": {"name": TOOL["name"],
             "description": TOOL["description"], "parameters": TOOL["input_schema"]}}] * 20
    assert estimate_prompt_tokens({**bare, "tools": chat}) - estimate_prompt_tokens(bare) >= (
        len(orjson.dumps(chat)) // 4)
    facts = parse_body(orjson.dumps({**bare, "tools": tools}), requires_max_tokens=True,
                       caps=("max_tokens",))
    assert facts.reserve(100, 1000) == messages + 5
    deep: Any = "x" * 40
    for _ in range(300):  # past orjson's depth for dumps: walked instead, never raised
        deep = [deep]
    assert estimate_prompt_tokens({"tools": [deep]}) >= 10
    assert estimate_prompt_tokens({"tools": ["\ud800" * 40]}) >= 10  # the stdlib reads these


def test_an_image_counts_a_fixed_figure_not_its_base64() -> None:
    """A 200 KB JPEG as base64 counted as text was ~67,000 tokens (refused as impossible by
    a 50,000-token window); a URL image counted nothing. Each counts IMAGE_TOKENS, in the
    shapes of Messages, chat and Responses."""
    from gateway.authz.prompt_estimate import IMAGE_TOKENS
    data = "A" * 270_000  # ~200 KB of image, base64
    text = {"type": "text", "text": "What is in this picture?"}
    shapes = [
        {"messages": [{"role": "user", "content": [text, {"type": "image", "source": {
            "type": "base64", "media_type": "image/jpeg", "data": data}}]}]},
        {"messages": [{"role": "user", "content": [text, {"type": "image", "source": {
            "type": "url", "url": "https://example.com/cat.jpg"}}]}]},
        {"messages": [{"role": "user", "content": [text, {"type": "image_url", "image_url": {
            "url": f"data:image/jpeg;base64,{data}", "detail": "high"}}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": text["text"]},
                                                {"type": "input_image",
                                                 "image_url": f"data:image/jpeg;base64,{data}"}]}]},
    ]
    for body in shapes:
        est = estimate_prompt_tokens(body)
        assert IMAGE_TOKENS <= est <= IMAGE_TOKENS + 30, (body["messages" if "messages" in body
                                                                else "input"], est)
    two = {"messages": [{"role": "user", "content": [shapes[2]["messages"][0]["content"][1]] * 2}]}
    assert estimate_prompt_tokens(two) >= 2 * IMAGE_TOKENS


def test_a_document_counts_a_fixed_figure_not_its_base64() -> None:
    """A 1 MB PDF as base64 counted as text was ~330,000 tokens (refused as impossible by
    most windows). Each document part counts DOCUMENT_TOKENS, in the shapes of Messages
    (base64, URL, file id), chat (`file`) and Responses (`input_file`); its title and
    context are text, and a document of text is counted as text."""
    from gateway.authz.prompt_estimate import DOCUMENT_TOKENS
    data = "JVBERi0x" + "A" * 1_333_000  # ~1 MB of PDF, base64
    text = {"type": "text", "text": "Summarize this."}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": data}}
    shapes = [
        {"messages": [{"role": "user", "content": [text, pdf]}]},
        {"messages": [{"role": "user", "content": [text, {"type": "document", "source": {
            "type": "url", "url": "https://example.com/report.pdf"}}]}]},
        {"messages": [{"role": "user", "content": [text, {"type": "document", "source": {
            "type": "file", "file_id": "file_011CNha8iCJcU1wXNR6q4V8w"}}]}]},
        {"messages": [{"role": "user", "content": [text, {"type": "file", "file": {
            "file_data": f"data:application/pdf;base64,{data}", "filename": "a.pdf"}}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": text["text"]},
                                                {"type": "input_file", "filename": "a.pdf",
                                                 "file_data": f"data:application/pdf;base64,"
                                                              f"{data}"}]}]},
    ]
    for body in shapes:
        est = estimate_prompt_tokens(body)
        assert DOCUMENT_TOKENS <= est <= DOCUMENT_TOKENS + 30, (est, str(body)[:200])
    titled = {**pdf, "title": "t" * 400, "context": "c" * 400}
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": [titled]}]}) >= (
        DOCUMENT_TOKENS + 200)
    plain = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "w" * 40_000}}
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": [plain]}]}) >= 10_000
    blocks = {"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "w" * 40_000}]}}
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": [blocks]}]}) >= 10_000
    a_result = {"type": "tool_result", "tool_use_id": "t1", "content": [pdf]}  # nested too
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": [a_result]}]}) <= (
        DOCUMENT_TOKENS + 30)


def test_a_type_that_is_not_a_string_is_walked_as_text() -> None:
    assert estimate_prompt_tokens({"messages": [{"type": ["image"], "text": "a" * 40}]}) >= 10
    assert estimate_prompt_tokens({"messages": [{"type": {"x": 1}, "text": "a" * 40}]}) >= 10


def _wav(seconds: float, rate: int = 16_000, channels: int = 1, width: int = 2,
         junk: int = 0) -> str:
    """A WAV of silence as base64, with a `junk`-byte chunk before its `fmt ` if asked."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(bytes(int(seconds * rate) * channels * width))
    raw = buf.getvalue()
    if junk:
        raw = raw[:12] + b"JUNK" + junk.to_bytes(4, "little") + bytes(junk) + raw[12:]
    return base64.b64encode(raw).decode()


def _chat_audio(data: Any, fmt: Any = "wav") -> dict[str, Any]:
    audio = {"data": data} if fmt is None else {"data": data, "format": fmt}
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Transcribe this."},
        {"type": "input_audio", "input_audio": audio}]}]}


def test_audio_counts_its_duration_not_its_base64() -> None:
    """One minute of 16 kHz WAV is ~2.5 MB of base64: counted as text, ~640,000 tokens,
    refused as "can never pass" by any window, while audio models spend 10-25 tokens a
    second. A WAV counts its duration from its header's byte rate, in chat's and Responses'
    `input_audio` and vLLM's `audio_url` (a data: URL)."""
    minute = _wav(60)
    assert len(minute) > 2_500_000
    shapes = [
        _chat_audio(minute),
        _chat_audio(minute, None),  # no format: the header says WAV
        _chat_audio(f"data:audio/wav;base64,{minute}"),
        {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "Transcribe this."},
            {"type": "input_audio", "input_audio": {"data": minute, "format": "wav"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {
            "url": f"data:audio/wav;base64,{minute}"}}]}]},
    ]
    for body in shapes:
        est = estimate_prompt_tokens(body)
        assert 300 <= est <= 3000, (est, str(body)[:200])
    # the byte rate is read, not assumed: 10 s of 48 kHz stereo is as long as 10 s of 16 kHz
    # mono, and a chunk before `fmt ` (Broadcast WAV's, Pro Tools' JUNK) is stepped over
    ten = estimate_prompt_tokens(_chat_audio(_wav(10)))
    assert 50 <= ten <= 500
    assert estimate_prompt_tokens(_chat_audio(_wav(10, 48_000, 2))) <= ten + 5
    assert estimate_prompt_tokens(_chat_audio(_wav(10, 48_000, 2, junk=28))) <= ten + 5
    assert estimate_prompt_tokens(_chat_audio(_wav(120))) - ten >= 110 * 20  # it scales


def test_compressed_audio_assumes_a_low_bitrate() -> None:
    """An MP3's duration is not in its first bytes: a low bitrate is assumed, so one minute
    at 128 kbps is reserved a few minutes' worth, the right order and never too little."""
    mp3 = base64.b64encode(b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(960_000)).decode()
    est = estimate_prompt_tokens(_chat_audio(mp3, "mp3"))
    assert 600 <= est <= 10_000, est
    url = {"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{mp3}"}}
    assert 600 <= estimate_prompt_tokens({"messages": [{"role": "user", "content": [url]}]}) <= est


def test_audio_and_video_urls_count_a_fixed_figure() -> None:
    """A URL cannot be sized on the request path: audio counts AUDIO_URL_TOKENS (one 30 s
    window), a video VIDEO_TOKENS (sampled frames), whatever its URL or data."""
    from gateway.authz.prompt_estimate import AUDIO_URL_TOKENS, IMAGE_TOKENS, VIDEO_TOKENS
    for part, tokens in (
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
         AUDIO_URL_TOKENS),
        ({"type": "audio_url", "audio_url": "https://example.com/a.wav"}, AUDIO_URL_TOKENS),
        ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, VIDEO_TOKENS),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + "A" * 4_000_000}},
         VIDEO_TOKENS),
        # vLLM's precomputed embeddings: a base64 tensor, not text
        ({"type": "image_embeds", "image_embeds": "A" * 6_000_000}, IMAGE_TOKENS),
        ({"type": "audio_embeds", "audio_embeds": "A" * 6_000_000}, AUDIO_URL_TOKENS),
    ):
        est = estimate_prompt_tokens({"messages": [{"role": "user", "content": [part]}]})
        assert tokens <= est <= tokens + 10, (part["type"], est)


def test_a_malformed_audio_part_never_raises() -> None:
    """Data not a string, no format, a header that is not base64, a truncated or lying
    header: each counts something bounded (the engine answers its own 400)."""
    from gateway.authz.prompt_estimate import VIDEO_TOKENS
    minute = _wav(60)
    bad = [
        _chat_audio(12345), _chat_audio(None), _chat_audio(["x"]), _chat_audio({"a": 1}),
        _chat_audio("!!!not base64!!!" * 1000), _chat_audio("é" * 1000), _chat_audio(""),
        _chat_audio("UklGRg"), _chat_audio(minute[:40]), _chat_audio("data:audio/wav"),
        _chat_audio(minute, 7), _chat_audio(minute, ["wav"]),
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": None}]}]},
    ]
    for body in bad:
        assert 1 <= estimate_prompt_tokens(body) <= 3000, str(body)[:120]
    no_url = {"messages": [{"role": "user", "content": [{"type": "video_url"}]}]}
    assert VIDEO_TOKENS <= estimate_prompt_tokens(no_url) <= VIDEO_TOKENS + 10
    # a header that claims 1 byte a second (or 4 GB) is bounded to real rates
    raw = bytearray(base64.b64decode(minute))
    for rate in (1, 2**32 - 1):
        raw[28:32] = rate.to_bytes(4, "little")
        est = estimate_prompt_tokens(_chat_audio(base64.b64encode(raw).decode()))
        assert 50 <= est <= 12_000, (rate, est)
