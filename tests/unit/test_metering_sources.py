"""The metering source as an object (gateway/metering/sources.py): the lookup from the
setting's name, its error, and what each source asks of the sidecar and of Envoy."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from pydantic import ValidationError

from gateway.envoyconf.bootstrap import EnvoyPorts, bootstrap, render
from gateway.envoyconf.filters import SIDECAR_CLUSTER
from gateway.envoyconf.metering import OTEL_ACCESS_LOG, RECORDS_HTTP_CLUSTER
from gateway.metering.sources import ENVOY, EXT_PROC, SOURCES, source_named
from gateway.settings import DEFAULT_METERING, METERING_SOURCES, Settings


def test_each_setting_value_names_its_source() -> None:
    assert source_named("envoy") is ENVOY
    assert source_named("ext_proc") is EXT_PROC
    assert tuple(SOURCES) == METERING_SOURCES  # the setting's values, in its order
    assert all(source_named(name).name == name for name in METERING_SOURCES)
    assert source_named(DEFAULT_METERING) is ENVOY


@pytest.mark.parametrize("name", ["lua", "ENVOY", "", "ext-proc"])
def test_an_unknown_name_is_refused_naming_the_valid_ones(name: str) -> None:
    with pytest.raises(ValueError) as exc:
        source_named(name)
    assert str(exc.value) == f"metering: {name!r} is not one of envoy, ext_proc"


def test_a_source_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ENVOY.watches = False  # type: ignore[misc]


def test_the_envoy_source() -> None:
    """Envoy meters in its own filters and sends a record of every request, with a heartbeat
    while it lives: the records are the events, and they alone keep an admission alive."""
    s = ENVOY
    assert (s.concurrency_grace_s, s.orphan_grace_s) == (0.1, 45.0)
    assert s.watches and s.records_are_events
    assert s.heartbeat and s.lua_filters and not s.ext_proc_filter
    assert not s.portable  # an Envoy you configure: the dev spoke's Check takes the HTTP door


def test_the_ext_proc_source() -> None:
    """The sidecar sees every chunk through ext_proc, whose stream renews the lease; Envoy's
    records only tell who cut a stream."""
    s = EXT_PROC
    assert (s.concurrency_grace_s, s.orphan_grace_s) == (0.0, 0.0)
    assert not s.watches and not s.records_are_events
    assert not s.heartbeat and not s.lua_filters and s.ext_proc_filter
    assert s.portable  # any Envoy with ext_authz and ext_proc: the gRPC Check


@pytest.mark.parametrize("name", METERING_SOURCES)
def test_settings_resolve_their_source_and_its_graces(name: str) -> None:
    s = Settings(metering=name)
    assert s.source is source_named(name)
    assert s.concurrency_grace_s == s.source.concurrency_grace_s
    assert s.orphan_grace_s == s.source.orphan_grace_s
    given = Settings(metering=name, concurrency_grace_ms=250, orphan_grace_ms=7000)
    assert (given.concurrency_grace_s, given.orphan_grace_s) == (0.25, 7.0)


def test_settings_keep_refusing_an_unknown_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_METERING", "lua")
    with pytest.raises(ValidationError, match="Input should be 'envoy' or 'ext_proc'"):
        Settings()
    monkeypatch.delenv("GATEWAY_METERING")
    assert Settings().source is ENVOY


def test_the_envoy_config_refuses_an_unknown_source() -> None:
    with pytest.raises(ValueError, match="metering: 'lua' is not one of envoy, ext_proc"):
        bootstrap(metering="lua")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "over_http"), [("envoy", True), ("ext_proc", False)])
def test_only_the_envoy_source_sends_its_records_over_otlp_http(name: str,
                                                                over_http: bool) -> None:
    """`--records-http` is the Envoy source's: ext_proc's early-end records must reach the
    sidecar process that ran the stream, so they stay on the gRPC connection the ext_proc
    streams use (tests/e2e/test_workers_ext_proc_metering.py); no records_http cluster."""
    doc = yaml.safe_load(render(EnvoyPorts(records_http="127.0.0.1:9003"), metering=name))
    clusters = {c["name"] for c in doc["static_resources"]["clusters"]}
    [hcm] = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    [log] = [a for a in hcm["typed_config"]["access_log"] if a["name"] == OTEL_ACCESS_LOG]
    config = log["typed_config"]
    assert (RECORDS_HTTP_CLUSTER in clusters) is over_http
    assert ("http_service" in config) is over_http
    if not over_http:
        grpc = config["common_config"]["grpc_service"]["envoy_grpc"]
        assert grpc["cluster_name"] == SIDECAR_CLUSTER
