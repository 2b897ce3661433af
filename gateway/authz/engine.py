"""The authorization pipeline: identity → route → body → model → ACL → admission, first
failure wins (the route rules, and why they are judged on the canonical path: gateway/routes.py).

Cheap checks come first, so an unknown key costs no JSON parse and no Redis call.
The limiter store failing (down, or past its deadline), or the usage spool unable to write
(`gate`), are the only ways to a 503: fail closed, never allow unmetered.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.authz import answers
from gateway.authz.decision import Allow, Callers, Context, Decision, Deny, Reply
from gateway.authz.request import AuthzRequest, BodyFacts, api_key, named_model, parse_body
from gateway.clock import Clock
from gateway.endpoints import ENDPOINTS, Api, api_of
from gateway.envoy_contract import CONTENT_ENCODING, PARTIAL_BODY_HEADER
from gateway.errors import BodyError, PathError, StoreInDoubt, StoreUnavailable
from gateway.limits.ledger import Ledger
from gateway.limits.types import (
    CONCURRENCY,
    AdmitRequest,
    Admitted,
    DuplicateId,
    Limiter,
    Refused,
    Verdict,
    Voided,
)
from gateway.log import log
from gateway.metering import handoff, inject
from gateway.policy import secrets
from gateway.policy.model import KeyRecord, Policy
from gateway.routes import Kind, canonical_path, route
from gateway.sinks.gate import UsageGate
from gateway.token_weights import TokenWeights

# An admission the store fails logs its error at most this often (limiter_admission_failed):
# every Check of an outage fails the same way.
STORE_FAILED_LOG_S = 60.0
# No request id with one of these is admitted: admit.lua splits on \x1f, \x1e starts a ticket.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class AdmissionSettings:
    default_completion_tokens: int = 1024  # reserved when the request names no max_tokens
    reserve_cap: int = 32768  # on the whole completion side, all sequences (BodyFacts.reserve)
    continuous_models: tuple[str, ...] = ()  # globs: models whose engine reports continuous usage
    # A concurrency denial waits up to this for ends still on their way (Envoy-fed metering
    # learns of an end ~50 ms after the client did), then retries: no spurious 429.
    concurrency_grace_s: float = 0.0


class Authorizer:
    """`ledger` follows what is admitted here to its end: it is told of each admission that
    owes the store its end, and of those nobody will act on (`abandon`). While `gate` is
    closed (the usage spool cannot write) new requests are refused with 503."""

    def __init__(
        self,
        policy: Callable[[], Policy | None],
        limiter: Limiter,
        clock: Clock,
        settings: AdmissionSettings = AdmissionSettings(),
        *,
        ledger: Ledger,
        gate: UsageGate | None = None,
    ) -> None:
        self._policy = policy
        self._limiter = limiter
        self._clock = clock
        self._settings = settings
        self._ledger = ledger
        self._gate = gate if gate is not None else UsageGate()
        self._callers = Callers()  # what every allowed request of a key and model carries
        self._store_failed_logged = -STORE_FAILED_LOG_S  # monotonic: the last such line

    def _log_store_failure(self, exc: StoreUnavailable) -> None:
        """The store's error for an admission it failed, at most once a STORE_FAILED_LOG_S."""
        at = time.monotonic()
        if at - self._store_failed_logged >= STORE_FAILED_LOG_S:
            self._store_failed_logged = at
            log.error("limiter_admission_failed", error=str(exc),
                      in_doubt=isinstance(exc, StoreInDoubt))

    async def check(self, req: AuthzRequest) -> Decision:
        decision = await self._check(req)
        if isinstance(decision, Deny) and (api := api_of(req.path)) is not Api.OPENAI:
            return replace(decision, api=api)  # answered as the route's clients expect
        return decision

    async def _check(self, req: AuthzRequest) -> Decision:
        policy = self._policy()
        if policy is None:
            return answers.unavailable("No policy loaded yet; the gateway denies everything.")
        secret = api_key(req.headers)
        if secret is None:
            return answers.unauthorized("Missing or malformed API key.")
        key = policy.keys_by_digest.get(secrets.digest(secret))
        now = self._clock.now()
        if key is None:
            return answers.unauthorized()
        if key.disabled or (key.expires_at is not None and key.expires_at <= now):
            return _who(answers.unauthorized(), key)  # a known key: its event names it
        try:
            path = canonical_path(req.path)
        except PathError as exc:
            return _who(answers.bad_request(str(exc)), key)
        where = route(req.method, path, policy.passthrough)
        if where.kind is Kind.UNKNOWN:
            return _who(answers.unknown_url(req.method, path), key)
        if where.kind is Kind.MODELS:
            return answers.models_list(policy.models_for(key), key.key_id, key.team)
        if where.kind is Kind.MODEL:
            return _model_answer(policy, key, where.model)
        if req.headers.get(PARTIAL_BODY_HEADER) == "true":  # truncated: it says nothing
            return _who(answers.partial_body(), key)
        if (encoding := req.headers.get(CONTENT_ENCODING)) is not None and \
                encoding.strip().lower() not in ("", "identity"):
            # compressed: it names no model we can read, and the engine may decompress it
            return _who(answers.encoded_body(encoding), key)
        endpoint = ENDPOINTS.get(path) if where.kind is Kind.INFERENCE else None
        try:
            if endpoint is not None:
                facts = parse_body(req.body, endpoint.requires_max_tokens, endpoint.caps,
                                   endpoint.fanout, endpoint.list_prompts)
            else:
                facts = named_model(req.body) or BodyFacts(model=None, body_bytes=len(req.body))
        except BodyError as exc:
            return _who(answers.bad_request(str(exc)), key)
        if facts.model is not None:
            if facts.model not in policy.models:
                return _who(answers.model_not_found(facts.model), key, facts=facts)
            if not key.may_use(facts.model):
                return _who(answers.model_not_allowed(facts.model), key, facts.model, facts)
        s = self._settings
        billed = facts.model is not None and (endpoint is None or endpoint.billed)
        # No model, or an endpoint that bills none: no tokens. A model with token weights
        # reserves its weighted count; without (the policy has none: one truth test), the
        # prompt estimate + the completion bound.
        weights: TokenWeights | None = None
        bound = reserve = 0
        if billed:
            bound = facts.completion_bound(s.default_completion_tokens, s.reserve_cap,
                                           endpoint is None or endpoint.generates)
            weights = policy.token_weights(facts.model or "")
            reserve = (facts.prompt_tokens + bound if weights is None
                       else weights.reserve(facts.prompt_tokens, bound))
        tiers = policy.tiers_for(facts.model, key)
        if self._gate.closed:  # its usage could not be recorded: refused as it stands
            return _who(answers.usage_unrecordable(self._gate.reason), key, facts.model, facts)
        verdict: Verdict = Admitted()  # no limits: nothing to admit, nothing owed
        if tiers and not req.request_id:  # its slots and its event would have no name
            return _who(answers.bad_request(
                "The request has no x-request-id; the gateway admits none without one."), key,
                facts=facts)
        if tiers and _CONTROL.search(req.request_id):
            # The admission scripts join a request's fields with \x1f and know a ticket by
            # its leading \x1e: such an id failed admit.lua for every request batched with
            # it. Envoy refuses such a header (400); another caller of the Check may not.
            return _who(answers.bad_request(
                "The request's x-request-id has a control character; the gateway admits "
                "none with one."), key, facts=facts)
        if tiers:
            try:
                verdict = await self._admit(AdmitRequest(
                    req.request_id, tiers, reserve, now,
                    meta=handoff.orphan_meta(key.key_id, key.team, facts.model or "", path,
                                             facts.stream),
                    # An endpoint that bills no tokens by its nature (count_tokens) is held to
                    # rps and concurrency only: a spent token window does not refuse it. Any
                    # other request is held to them, whatever it reserves (max_tokens 0).
                    tokens=endpoint is None or endpoint.billed))
            except StoreUnavailable as exc:
                # The client is told which of the two it was, never the store's own error
                # (its addresses, its exception names): that is logged here (limiter_
                # admission_failed, once a minute at most: also a store that answers the
                # probe's ping yet fails admissions, a script error or OOM), and a store
                # that does not answer by the probe (limiter_store_unreachable).
                self._log_store_failure(exc)
                if isinstance(exc, StoreInDoubt):
                    self.abandon(req.request_id)  # it may still commit: undo it
                    why = "it did not answer in time"
                else:
                    why = "it cannot be reached"
                return _who(answers.unavailable(
                    f"Rate limiter unavailable ({why}); failing closed."), key, facts.model, facts)
        if isinstance(verdict, DuplicateId):
            return _who(answers.duplicate_request_id(req.request_id), key, facts.model, facts)
        if isinstance(verdict, Voided):
            return _who(answers.voided_request_id(req.request_id), key, facts.model, facts)
        if isinstance(verdict, Refused):
            return _who(answers.limit_denial(verdict, reserve, facts.prompt_tokens if billed
                                             else None, weights, bound), key, facts.model,
                        facts)
        owed = verdict.owes_settlement
        if owed:
            self._ledger.admitted(req.request_id)
        ctx = Context(
            req.request_id,
            self._callers.get(policy.revision, key.key_id, key.team, facts.model or "",
                              key.cancelled, key.inference_objective, weights),
            facts.stream, reserve if owed else 0, owed, endpoint=path,
            prompt_estimate=facts.prompt_tokens if billed else 0,
            stream_options=facts.stream_options, include_usage=facts.include_usage,
            continuous_usage=facts.continuous_usage,
            splice=inject.plan(req.body, path, facts.model or "", facts.stream,
                               facts.options_member, facts.include_usage,
                               facts.continuous_usage, s.continuous_models),
        )
        return Allow(ctx, verdict.rate)

    async def _admit(self, req: AdmitRequest) -> Verdict:
        """Admit; a concurrency denial waits (within the grace) for releases on their way
        and tries again. A denial commits nothing, so a retry is a fresh admission. The
        grace counts from the first call, so a Check takes at most the grace plus one store
        deadline (a slow first answer is not tried again): inside Envoy's timeout."""
        started = time.monotonic()
        verdict = await self._limiter.admit(req)
        grace = self._settings.concurrency_grace_s
        if not grace or not _no_slot(verdict):
            return verdict
        give_up = started + grace
        while _no_slot(verdict) and (left := give_up - time.monotonic()) > 0:
            await self._ledger.outbox.next_flush(left)
            verdict = await self._limiter.admit(replace(req, now=self._clock.now()))
        return verdict

    def abandon(self, request_id: str) -> None:
        """Nobody will act on this request's admission (we gave up on the store, or Envoy
        gave up on us): undo whatever the store committed, or will commit, for it."""
        self._ledger.voided(request_id)


def _no_slot(verdict: Verdict) -> bool:
    """Refused for concurrency: a slot may be freed by an end on its way to the store."""
    return isinstance(verdict, Refused) and verdict.limit == CONCURRENCY


def _who(deny: Deny, key: KeyRecord, model: str | None = None,
         facts: BodyFacts | None = None) -> Deny:
    """Name the (authenticated) caller on a denial, for its usage event and logs, with
    whether it asked for a stream once its body was read."""
    return replace(deny, key_id=key.key_id, team=key.team, model=model or "",
                   stream=facts.stream if facts is not None else False)


def _model_answer(policy: Policy, key: KeyRecord, model: str) -> Reply | Deny:
    """GET /v1/models/{id}: the model, if this key may use it; as OpenAI answers it."""
    if model not in policy.models:
        return _who(answers.model_not_found(model), key)
    if not key.may_use(model):
        return _who(answers.model_not_allowed(model), key, model)
    return answers.model_object(model, key.key_id, key.team)
