"""Token usage as engines report it, per endpoint; None = not reported (distinct from 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


def _n(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _detail(obj: Any, section: str, field: str) -> int:
    d = obj.get(section) if isinstance(obj, dict) else None
    return _n(d.get(field)) if isinstance(d, dict) else 0


def _usage(u: Any, prompt: str, completion: str, prompt_details: str,
           completion_details: str) -> Usage | None:
    if not isinstance(u, dict):
        return None
    p, c = _n(u.get(prompt)), _n(u.get(completion))
    return Usage(
        prompt_tokens=p,
        completion_tokens=c,
        total_tokens=_n(u.get("total_tokens")) or p + c,
        cached_tokens=_detail(u, prompt_details, "cached_tokens"),
        reasoning_tokens=_detail(u, completion_details, "reasoning_tokens"),
    )


def from_openai(u: Any) -> Usage | None:
    """Chat/completions/embeddings `usage` object (also vLLM's continuous usage)."""
    return _usage(u, "prompt_tokens", "completion_tokens", "prompt_tokens_details",
                  "completion_tokens_details")


def from_responses(u: Any) -> Usage | None:
    """Responses API `usage`: input/output tokens."""
    return _usage(u, "input_tokens", "output_tokens", "input_tokens_details",
                  "output_tokens_details")


def from_body(endpoint: str, obj: Any) -> tuple[Usage | None, str]:
    """(usage, served model) of a complete non-stream JSON response, or of one SSE event."""
    if not isinstance(obj, dict):
        return None, ""
    if endpoint == "/v1/responses":
        inner = obj.get("response") if "response" in obj else obj
        if isinstance(inner, dict):
            model = inner.get("model")
            return from_responses(inner.get("usage")), model if isinstance(model, str) else ""
        return None, ""
    model = obj.get("model")
    return from_openai(obj.get("usage")), model if isinstance(model, str) else ""
