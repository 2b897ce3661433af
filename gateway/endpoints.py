"""The inference endpoints the gateway knows, in one list that both services consult.

An entry says everything that differs between API shapes: which family of answers its
clients expect (errors, rate-limit headers), how its usage is read, whether it generates
tokens to reserve, whether it is billed at all, and whether its streams report usage only
when asked. The next API shape is one entry here, plus its usage reader if it is new
(gateway/metering/usage.py, and the Envoy rules in gateway/envoyconf/metering.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Api(Enum):
    OPENAI = "openai"  # {"error": {...}} bodies, x-ratelimit-* headers
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {...}}, anthropic-ratelimit-*


class Reader(Enum):
    """How usage is read from an answer, and how its stream ends."""

    CHAT = "chat"  # `usage` in the body / last SSE chunk; the stream ends with `data: [DONE]`
    RESPONSES = "responses"  # Responses API: `usage` of the response; response.completed ends
    MESSAGES = "messages"  # Anthropic: message_start + cumulative message_delta; message_stop
    NONE = "none"  # nothing to bill (count_tokens)


# The body fields that say how many sequences the engine generates (every one up to the
# completion cap), with the most the API accepts: OpenAI's `n` (1-128, chat and completions)
# and the completions API's `best_of` (up to 20: the engine generates best_of candidates,
# bills them all and returns the best n; vLLM's V0 engine honours it, V1 refuses it).
N = ("n", 128)
BEST_OF = ("best_of", 20)


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    api: Api
    reader: Reader
    generates: bool = True  # completion tokens are reserved (max_tokens or the default)
    # False: admitted and rate-limited as a request, no tokens at all: it reserves none and
    # no token window refuses it (rps and concurrency do), as Anthropic's free count_tokens
    billed: bool = True
    injects_usage: bool = False  # a stream reports usage only if asked (stream_options)
    requires_max_tokens: bool = False  # the API itself requires it (Anthropic)
    # The body fields that bound what the engine generates, as this API reads them (the first
    # one given): another API's field in the body bounds nothing, and reserves nothing.
    caps: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    # The body fields that say how many sequences the engine generates, each up to the cap,
    # with the most the API accepts (gateway/authz/request.py `sequences`): the completion
    # side of the reservation is multiplied by the largest. None: one sequence.
    fanout: tuple[tuple[str, int], ...] = ()
    list_prompts: bool = False  # a list `prompt` is several prompts, each gets them all


ENDPOINTS: dict[str, Endpoint] = {e.path: e for e in (
    Endpoint("/v1/chat/completions", Api.OPENAI, Reader.CHAT, injects_usage=True,
             fanout=(N,)),
    Endpoint("/v1/completions", Api.OPENAI, Reader.CHAT, injects_usage=True,
             caps=("max_tokens",), fanout=(N, BEST_OF), list_prompts=True),
    Endpoint("/v1/embeddings", Api.OPENAI, Reader.CHAT, generates=False, caps=()),
    Endpoint("/v1/responses", Api.OPENAI, Reader.RESPONSES, caps=("max_output_tokens",)),
    Endpoint("/v1/messages", Api.ANTHROPIC, Reader.MESSAGES, requires_max_tokens=True,
             caps=("max_tokens",)),
    Endpoint("/v1/messages/count_tokens", Api.ANTHROPIC, Reader.NONE, generates=False,
             billed=False, caps=()),
)}

ANTHROPIC_PREFIX = "/v1/messages"
MODELS_PATH = "/v1/models"  # answered by the gateway itself (gateway/routes.py)
MODEL_PREFIX = MODELS_PATH + "/"


def api_of(path: str) -> Api:
    """The answer family for a request path as sent (even one that does not canonicalize):
    Anthropic's under /v1/messages, OpenAI's everywhere else."""
    endpoint = ENDPOINTS.get(path)
    if endpoint is not None:
        return endpoint.api
    return Api.ANTHROPIC if path.startswith(ANTHROPIC_PREFIX) else Api.OPENAI


def reader_of(path: str) -> Reader:
    endpoint = ENDPOINTS.get(path)
    return endpoint.reader if endpoint is not None else Reader.CHAT


def billed(path: str) -> bool:
    """Whether a request to `path` is billed: not count_tokens, nor the gateway's own
    read-only answers (`GET /v1/models`, `/v1/models/{id}`): their events say `reported`,
    with no tokens. Any other path (a pass-through) is billed what its answer reports."""
    endpoint = ENDPOINTS.get(path)
    if endpoint is not None:
        return endpoint.billed
    return path != MODELS_PATH and not path.startswith(MODEL_PREFIX)
