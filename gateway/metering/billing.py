"""How a request is billed, from its facts (pure): the one place the rules live.

Both metering sources describe a response the same way (gateway/metering/facts.py
`ResponseFacts`: ext_proc's Meter, Envoy's record); `settle` turns the Check's facts and
the response's into the event's outcome, its usage and that usage's source, and the
cancellation bill (gateway/metering/cancel.py). The recorder writes the event from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.endpoints import billed
from gateway.envoy_contract import UPSTREAM_FLAGS
from gateway.limits.types import Checkpoint
from gateway.metering.cancel import bill
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.token_weights import TokenWeights, limit_tokens
from gateway.usage_event import NOT_CANCELLED, Cancellation, Usage


@dataclass(slots=True)  # not frozen: that costs µs a request (treated as immutable all the same)
class Billed:
    """What the usage event says about a request."""

    outcome: str  # completed | client_cancelled | upstream_error | denied
    status: int
    usage: Usage  # what is billed (a cancelled stream: by its team's rule)
    source: str  # reported | estimated | checkpoint; "" when denied (nothing was metered)
    served_model: str = ""
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    cancellation: Cancellation = NOT_CANCELLED


def outcome(request: RequestFacts, response: ResponseFacts) -> str:
    if request.denied_status or not request.key_id:
        return "denied"  # ext_authz said no, or Envoy answered itself (413, 503, ...)
    if response.flags & UPSTREAM_FLAGS or response.status >= 500 or response.engine_error:
        return "upstream_error"  # the engine failed, cut its stream, or said so mid-stream
    # A client that stops reading at the engine's end marker may hang up before the
    # response's end reaches the proxy: it still got everything.
    return "completed" if response.ended or response.end_seen else "client_cancelled"


def metered(response: ResponseFacts, prompt_estimate: int) -> tuple[Usage, str]:
    """What was used: as the engine reported it, else estimated from what streamed (the
    prompt from the Check's estimate, the completion from the content that passed)."""
    u = response.usage
    if u is not None and not response.input_only:
        return u, "reported"
    completion = response.delivered
    if u is not None:  # the input side is exact (Anthropic's message_start)
        return Usage(u.prompt_tokens, completion, u.prompt_tokens + completion,
                     u.cached_tokens, 0, u.cache_creation_tokens), "estimated"
    if response.status >= 400 and not completion:
        return Usage(), "reported"  # an error answer: nothing was generated
    # An answer with no status was never begun: nothing. One begun bills the prompt, a
    # success with no body too (a 204, an empty 200: no completion): the engine accepted
    # the request and answered it as a success, and the prompt is what the admission
    # reserved; an engine's bodiless success is not an error the client is spared.
    prompt = prompt_estimate if response.status or completion else 0
    return Usage(prompt, completion, prompt + completion), "estimated"


def checkpoint(request: RequestFacts, response: ResponseFacts) -> Checkpoint | None:
    """(prompt, completion) tokens a request in flight has used so far, for its admission's
    checkpoint, and the weighted count for a model with token weights; None for one denied
    (it holds none)."""
    if outcome(request, response) == "denied":
        return None
    u, _ = metered(response, request.prompt_estimate)
    return progress(u, request.weights)


def progress(u: Usage, weights: TokenWeights | None) -> Checkpoint:
    """A checkpoint of usage so far: (prompt, completion), and the count the token limits
    are charged (limit_tokens) only when the model has weights (the default checkpoint is
    what it always was), then the prompt's cached and cache-creation tokens when it has
    any: an orphan's event carries them, so it counts what the sweep charged."""
    if weights is None:
        return u.prompt_tokens, u.completion_tokens
    weighted = u.prompt_tokens, u.completion_tokens, limit_tokens(u, weights)
    cache = u.cached_tokens, u.cache_creation_tokens
    return (*weighted, *cache) if any(cache) else weighted


def settle(request: RequestFacts, response: ResponseFacts) -> Billed:
    """The request's outcome and bill."""
    how = outcome(request, response)
    if how == "denied":
        return Billed(how, request.denied_status or response.status, Usage(), "",
                      response.served_model)
    counted = billed(request.endpoint)
    if counted:
        usage, source = metered(response, request.prompt_estimate)
    else:  # e.g. count_tokens: admitted as a request, no tokens
        usage, source = Usage(), "reported"
    tpot = 0.0
    if response.generation_ms is not None and usage.completion_tokens > 1:
        tpot = response.generation_ms / (usage.completion_tokens - 1)
    cancellation = NOT_CANCELLED
    if how == "client_cancelled":  # billed by the team's rule, as admitted
        usage, cancellation = bill(usage, response.delivered if counted else 0,
                                   request.cancelled)
    return Billed(how, response.status, usage, source, response.served_model,
                  response.ttft_ms, tpot, cancellation)


def orphaned(request: RequestFacts, checkpoint: tuple[int, int] | None,
             charged: int, cache: tuple[int, int] = (0, 0)) -> Billed:
    """A request whose sidecar died mid-request: no response facts, only what its admission
    stored. Billed what its stream had used at its last lease renewal (`checkpoint`: raw
    tokens; its limits were charged `charged`, weighted for a model with weights), else
    `charged`: what the sweep left charged to its quotas, 0 without a checkpoint (sweep.lua:
    the platform lost track of it, so only what was seen is billed). `cache`: the
    checkpoint's (cached, cache-creation) prompt tokens (a weighted model's)."""
    if not billed(request.endpoint):
        return Billed("upstream_error", 0, Usage(), "reported")
    if checkpoint is not None:
        prompt, completion = checkpoint
        return Billed("upstream_error", 0, Usage(prompt, completion, prompt + completion,
                                                 cache[0], 0, cache[1]), "checkpoint")
    return Billed("upstream_error", 0, Usage(prompt_tokens=charged, total_tokens=charged),
                  "estimated")
