"""The gateway's own read-only answers (GET /v1/models, /v1/models/{id}) bill nothing and
say so as count_tokens does (`reported`, no tokens), not `estimated`; a pass-through path
is still billed what its answer reports."""

from __future__ import annotations

from gateway.endpoints import billed
from gateway.metering.billing import settle
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.usage_event import Usage


def _settled(endpoint: str, usage: Usage | None = None):  # type: ignore[no-untyped-def]
    request = RequestFacts(request_id="r", key_id="k", team="t", endpoint=endpoint)
    return settle(request, ResponseFacts(status=200, ended=True, end_seen=True, usage=usage))


def test_the_models_list_and_a_model_bill_nothing_and_say_reported() -> None:
    for path in ("/v1/models", "/v1/models/mock-model"):
        b = _settled(path)
        assert (b.outcome, b.source, b.usage) == ("completed", "reported", Usage()), path
        assert not billed(path)


def test_count_tokens_and_a_pass_through_keep_their_rules() -> None:
    assert not billed("/v1/messages/count_tokens")
    assert billed("/v1/chat/completions")
    assert billed("/v1/rerank")  # a pass-through the policy lists: billed what it reports
    b = _settled("/v1/rerank", Usage(5, 0, 5))
    assert (b.source, b.usage.total_tokens) == ("reported", 5)
    assert billed("/v1/modelsx")  # not the models path
