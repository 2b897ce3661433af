"""`gateway keys show KEY_ID`: a key's limits at each tier, and what is used and left now
in each window, read from the limiter's counters."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from gateway.limits import maths
from gateway.limits.standing import Counters, Standing, Window, standing
from gateway.policy.model import Policy, TierLimit

Read = Callable[[str, float], Awaitable[Counters]]  # (tier key, now) → its counters


def key_tiers(policy: Policy, key_id: str) -> list[TierLimit]:
    """The tiers a request of this key passes, from its own outward: the key, its team, and
    each model it may use (tiers that name no limit are left out)."""
    key = policy.keys[key_id]
    out = []
    if not key.limits.empty:
        out.append(TierLimit("key", key_id, key.limits))
    team = policy.teams.get(key.team)
    if team is not None and not team.empty:
        out.append(TierLimit("team", key.team, team))
    for model in policy.models_for(key):
        if not policy.models[model].empty:
            out.append(TierLimit("model", model, policy.models[model]))
    return out


async def standings(tiers: list[TierLimit], read: Read | None, now: float
                    ) -> list[Standing]:
    """Each tier where it stands; without a store (`read` None), the limits alone (used
    and left unknown: -1)."""
    out = []
    for t in tiers:
        if read is None:
            full = standing(t, Counters(), now)
            out.append(Standing(t.tier, t.name, tuple(
                replace(w, used=-1, left=-1, resets_in=None) for w in full.windows)))
        else:
            out.append(standing(t, await read(f"{t.tier}:{t.name}", now), now))
    return out


def state(policy: Policy, key_id: str, now: float) -> str:
    key = policy.keys[key_id]
    if key.disabled:
        return "disabled"
    return "expired" if key.expires_at is not None and key.expires_at <= now else "active"


def as_data(policy: Policy, key_id: str, rows: list[Standing], now: float,
            counters: bool) -> dict[str, Any]:
    key = policy.keys[key_id]
    entry = policy.doc.keys[key_id]
    objective, source = entry.objective(policy.doc.teams.get(entry.team))
    return {
        "key_id": key_id, "team": key.team, "state": state(policy, key_id, now),
        "revision": policy.revision,
        "models": policy.models_for(key),
        # the GIE InferenceObjective its requests name, and whose it is ("key", "team")
        "inference_objective": objective or None, "inference_objective_from": source or None,
        "expires_at": _utc(key.expires_at) if key.expires_at is not None else None,
        # old secrets (`keys rotate`) still valid, each until then; never a secret
        "old_secrets_until": [_utc(end.timestamp()) for end in
                              policy.doc.keys[key_id].old_secrets_end(_at(now))],
        "at": _utc(now), "counters": counters,
        # the key's models whose tokens count weighted toward every token window (each
        # model's weights); its token windows' numbers are then weighted tokens
        "token_weights": {m: {"input": w.input, "cached_input": w.cached_input,
                              "cache_creation": w.cache_creation, "output": w.output}
                          for m in policy.models_for(key)
                          if (w := policy.token_weights(m)) is not None},
        "tiers": [{"tier": s.tier, "name": s.name, "windows": [
            {"limit": w.limit, "allowed": _allowed(w, counters), "per_s": w.per_s,
             "quota": w.quota,
             "used": w.used if counters else None, "left": w.left if counters else None,
             "resets_in_s": round(w.resets_in, 3) if w.resets_in is not None else None}
            for w in s.windows]} for s in rows],
    }


def table(data: dict[str, Any]) -> str:
    lines = [f"key {data['key_id']}  team {data['team']}  {data['state']}  "
             f"expires {data['expires_at'] or 'never'}  (revision {data['revision']}, "
             f"at {data['at']})",
             f"models: {', '.join(data['models']) or 'none'}",
             f"inference objective: {_objective(data)}"]
    lines += [f"old secret still valid until {end} (keys rotate)"
              for end in data["old_secrets_until"]]
    lines.append("")
    head = ("TIER", "NAME", "LIMIT", "ALLOWED", "USED", "LEFT", "RESETS IN")
    rows = [(t["tier"], t["name"],
             _limit(w),
             _num(w["allowed"]), _num(w["used"]),
             _num(w["left"]), _dur(w["resets_in_s"]))
            for t in data["tiers"] for w in t["windows"]]
    if not rows:
        return "\n".join([*lines, "no limits at any tier: unlimited"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    for r in (head, *rows):
        lines.append("  ".join(v.ljust(w) if i < 3 else v.rjust(w)
                               for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    if any(w["quota"] is not None for t in data["tiers"] for w in t["windows"]):
        lines += ["", "global: a quota for all spokes together; ALLOWED is this spoke's "
                      "allowance of it (the hub's allocator divides it; without one held, "
                      f"the fallback share, {maths.GLOBAL_FALLBACK_SHARE:.0%}), USED this "
                      "spoke's use"]
    if data.get("token_weights"):
        lines += ["", "weighted tokens: the token windows count the weighted tokens of "
                      "requests for " + ", ".join(
                          f"{m} (input {_num(float(w['input']))}, cached_input "
                          f"{_num(float(w['cached_input']))}, cache_creation "
                          f"{_num(float(w['cache_creation']))}, output "
                          f"{_num(float(w['output']))})"
                          for m, w in sorted(data["token_weights"].items()))
                      + "; other models' tokens count as prompt + completion "
                        "(docs/policy.md, Weighted tokens)"]
    if not data["counters"]:
        lines += ["", "used and left need the limiter's counters: embedded mode keeps them in "
                      "the serving process (set GATEWAY_REDIS_URL for a spoke's)"]
    return "\n".join(lines)


def _objective(data: dict[str, Any]) -> str:
    if not data["inference_objective"]:
        return "none (x-gateway-inference-objective not sent)"
    whose = "the key's own" if data["inference_objective_from"] == "key" else \
        f"team {data['team']}'s"
    return f"{data['inference_objective']} ({whose})"


def _allowed(w: Window, counters: bool) -> float | None:
    """A global quota's allowance is the spoke's, in its store: unknown without it."""
    return None if w.quota is not None and not counters else w.allowed


def _limit(w: dict[str, Any]) -> str:
    if w["per_s"]:
        return f"rps {_num(w['per_s'])}/s, burst"
    if w["quota"] is not None:
        return f"{w['limit']} {_num(w['quota'])}, this spoke's"
    return str(w["limit"])


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:g}" if isinstance(v, float) and not v.is_integer() else f"{int(v)}"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    h, rest = divmod(int(s), 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
