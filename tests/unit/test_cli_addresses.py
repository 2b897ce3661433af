"""A listen address or upstream that is not host:port: one `error:` line naming the
setting, exit 2, nothing bound or connected (before: a ValueError traceback from
`gateway serve --metrics-listen`, `policy sync --metrics-listen`, `envoy-config --engine`;
a bad `--listen` failed inside gRPC's bind)."""

from __future__ import annotations

import pytest

from gateway.cli import main


@pytest.mark.parametrize("argv, named", [
    (["serve", "--listen", "nohost"], "GATEWAY_LISTEN"),
    (["serve", "--metrics-listen", "127.0.0.1:0"], "GATEWAY_METRICS_LISTEN"),
    (["serve", "--authz-http-listen", "127.0.0.1"], "GATEWAY_AUTHZ_HTTP_LISTEN"),
    (["policy", "sync", "--redis-url", "redis://127.0.0.1:1", "--metrics-listen", "nope"],
     "GATEWAY_SYNC_METRICS_LISTEN"),
    (["envoy-config", "--engine", "nope"], "engine"),
])
def test_a_bad_address_is_one_error_line_and_exit_2(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # policy sync needs one
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}: ") and "is not host:port" in err, err
    assert "Traceback" not in err
