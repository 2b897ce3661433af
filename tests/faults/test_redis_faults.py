"""Faults of the limiter's store under live traffic through Envoy (Redis killed, slow or
stalled; a corrupt policy revision in it), then the same invariants (invariants.py). The
sidecar's faults are test_sidecar_faults.py's, the broker's test_kafka_down.py's."""

from __future__ import annotations

import time

import pytest
from conftest import LEASE_TTL
from probes import Spk, gauge, served, serving_again, status, until
from proxy import SlowProxy

from gateway.cli import main as gateway
from testkit.invariants import check
from testkit.load import Load


def test_redis_killed_under_load_then_restarted(spoke_keys: Spk) -> None:
    spoke, keys = spoke_keys
    load = Load(spoke.base_url, keys["fault"]).start()
    served(load)
    spoke["redis"].kill()
    # Down until the sidecar has seen it (its watch runs every second) and refused some.
    until(lambda: gauge(spoke, "gateway_limiter_store_up") == 0
          and any(r.status == 503 for r in load.results[-20:]), 15,
          "the store seen down and a request refused")
    during = len(load.results)
    assert gauge(spoke, "gateway_limiter_store_up") == 0  # loud: a gauge to alert on
    spoke["redis"].restart()  # empty: the hub re-publishes policy; the sidecar kept its copy
    until(lambda: gauge(spoke, "gateway_limiter_store_up") == 1
          and '"limiter_store_recovered"' in spoke["sidecar"].log_path.read_text(), 15,
          "the store seen back")
    serving_again(load, during)
    assert gauge(spoke, "gateway_limiter_store_up") == 1
    log = spoke["sidecar"].log_path.read_text()
    assert '"limiter_store_unreachable"' in log and '"limiter_store_recovered"' in log
    # the operator's line says how (the clients' 503s do not)
    down = next(ln for ln in log.splitlines() if '"limiter_store_unreachable"' in ln)
    assert '"error"' in down, down
    results = load.stop()
    outage = results[during - 20:during]
    assert all(r.status in (200, 503) for r in results), {r.status for r in results}
    assert any(r.status == 503 for r in outage)  # failed closed, never an unmetered 200 ...
    assert results[-1].status == 200  # ... and recovered without a restart
    # Counters died with Redis: the token check only holds for the restarted Redis' life,
    # so it is left to the other faults; the rest must hold.
    stats = check(spoke, results, "fault", lease_ttl=LEASE_TTL, token_check=False)
    assert stats["admitted"] > 20


@pytest.mark.authz_only
@pytest.mark.serial  # 0.45 s against a 0.25 s deadline: no room for another worker's load
@pytest.mark.parametrize("mode", ["latency", "stall"])
def test_slow_redis_gets_503_within_the_deadline(spoke_keys: Spk, mode: str) -> None:
    spoke, keys = spoke_keys
    proxy = SlowProxy(spoke["redis"].port).start()
    sidecar = spoke["sidecar"]
    sidecar.stop()
    sidecar.env["GATEWAY_REDIS_URL"] = f"redis://127.0.0.1:{proxy.port}/0"
    sidecar.restart()
    try:
        deadline = time.monotonic() + 10
        while status(spoke, keys["fault"])[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status(spoke, keys["fault"])[0] == 200
        if mode == "latency":
            proxy.delay = 0.4  # > the 250 ms deadline
        else:
            proxy.stalled = True
        answers = [status(spoke, keys["fault"]) for _ in range(5)]
        assert [code for code, _ in answers] == [503] * 5  # never an allow
        assert max(t for _, t in answers) < 0.45  # the sidecar's deadline, not Envoy's 0.5 s
        proxy.delay, proxy.stalled = 0.0, False
        deadline = time.monotonic() + 10
        while status(spoke, keys["fault"])[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status(spoke, keys["fault"])[0] == 200
        # Admissions that committed after their deadline were voided: nothing leaked.
        check(spoke, [], "fault", lease_ttl=LEASE_TTL)
    finally:
        proxy.delay, proxy.stalled = 0.0, False
        proxy.stop()


@pytest.mark.authz_only
def test_corrupt_policy_revision_is_nacked_and_old_one_serves(spoke_keys: Spk,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    import asyncio

    from redis.asyncio import Redis

    from gateway.policy.store import PolicyStore

    spoke, keys = spoke_keys

    async def corrupt() -> None:
        store = PolicyStore(Redis.from_url(spoke.redis_url))
        rev = await store.current_revision()
        await store.publish_raw(rev + 1, b'{"keys": {"x": {"team": 7}}, "bogus": true}')
        await store.redis.aclose()

    asyncio.run(corrupt())
    time.sleep(0.5)
    assert status(spoke, keys["fault"])[0] == 200  # the previous revision keeps serving
    capsys.readouterr()
    assert gateway(["policy", "status", "--redis-url", spoke.redis_url]) == 1
    out = capsys.readouterr().out
    assert "NACK" in out and "bogus" in out
