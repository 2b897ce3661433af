"""An admission the limiter's store fails answers 503 without the store's error (its
addresses, its exception names), on the word that the error is logged. The store's probe
(`limiter_store_unreachable`) logs only a store that does not answer a ping: one that
answers it yet fails admissions (a script error, OOM, READONLY) had its error nowhere.
The admission path logs it itself, once a minute at most (a 503 per Check must not be a
line per Check)."""

from __future__ import annotations

import pytest

from gateway import log
from gateway.authz.decision import Deny
from gateway.authz.engine import AdmissionSettings, Authorizer
from gateway.authz.request import AuthzRequest
from gateway.clock import FakeClock
from gateway.errors import StoreUnavailable
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.limits.types import AdmitRequest, Verdict
from gateway.policy import secrets
from gateway.policy.loader import load

SECRET = "sk-gw-alice-" + "a" * 40
ERROR = "redis: RedisReplyError: OOM command not allowed when used memory > 'maxmemory'"


class _ScriptFails(MemoryLimiter):
    async def admit(self, req: AdmitRequest) -> Verdict:
        raise StoreUnavailable(ERROR)


async def test_a_failed_admission_logs_the_store_error_once_a_minute(
        capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("info", cache=False)
    pol = load(f"""
models: {{m: {{}}}}
teams: {{t: {{models: ["*"], limits: {{rps: 5, burst: 5}}}}}}
keys: {{alice: {{team: t, sha256: "{secrets.digest(SECRET).hex()}"}}}}
""", revision=1)
    clock = FakeClock(1_800_000_000.0)
    limiter = _ScriptFails()
    authz = Authorizer(lambda: pol, limiter, clock, AdmissionSettings(),
                       ledger=Ledger(limiter, clock, lease_ttl=30))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    for i in range(3):
        d = await authz.check(AuthzRequest(f"r{i}", "POST", "/v1/chat/completions",
                                           {"authorization": f"Bearer {SECRET}"}, body))
        assert isinstance(d, Deny) and d.status == 503
        assert "OOM" not in d.message  # the client is not told the store's error
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "OOM" in ln]
    assert len(lines) == 1, lines  # logged, and once for the three
    assert '"limiter_admission_failed"' in lines[0]
