"""deploy/: every example parses, and the Envoy Gateway policies ask of a managed Envoy what
`gateway envoy-config --metering ext_proc --grpc-check` asks of a plain one (deploy/README.md:
"the settings the sidecar expects, which are the ones `gateway envoy-config` renders").

Field names are Envoy Gateway's (api/v1alpha1 ext_auth_types.go, ext_proc_types.go); a field
the gateway leaves unset takes Envoy Gateway's default, which is not the renderer's for
`statusOnError` (403 for extAuth, 500 for extProc) nor for the Check's timeout (10 s)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.envoyconf.bootstrap import EnvoyPorts, render

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_STATUS = {"ServiceUnavailable": 503, "Forbidden": 403, "InternalServerError": 500}
_MODES = {"BUFFERED": "Buffered", "STREAMED": "Streamed", "FULL_DUPLEX_STREAMED":
          "FullDuplexStreamed", "BUFFERED_PARTIAL": "BufferedPartial"}


def _seconds(text: str) -> float:
    """A protobuf duration ("0.500s") or a Gateway API one ("500ms", "2s", "1m")."""
    total = 0.0
    for value, unit in re.findall(r"([0-9.]+)(ms|s|m|h)", text):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def _rendered_filters() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(render(EnvoyPorts(authz_http=None), metering="ext_proc"))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return {f["name"]: f["typed_config"] for f in hcm["typed_config"]["http_filters"]}


def _policy(kind: str) -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "envoy-gateway-policies.yaml").read_text()))
    return next(d["spec"] for d in docs if d["kind"] == kind)


# Kubernetes objects; prometheus-rules.yaml is a Prometheus rules file, checked against
# real processes' metrics in tests/integration/test_prometheus_rules.py
MANIFESTS = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "prometheus-rules.yaml")


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_example_parses(name: str) -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]
    assert docs and all({"apiVersion", "kind", "metadata", "spec"} <= d.keys() for d in docs)


def test_the_security_policy_asks_what_the_rendered_ext_authz_does() -> None:
    rendered = _rendered_filters()["envoy.filters.http.ext_authz"]
    ext_auth = _policy("SecurityPolicy")["extAuth"]
    assert ext_auth["failOpen"] is rendered["failure_mode_allow"] is False
    assert ext_auth["bodyToExtAuth"]["maxRequestBytes"] == \
        rendered["with_request_body"]["max_request_bytes"]
    assert ext_auth.get("statusOnError", 403) == _STATUS[rendered["status_on_error"]["code"]]
    assert _seconds(ext_auth.get("timeout", "10s")) == \
        _seconds(rendered["grpc_service"]["timeout"])
    assert ext_auth["grpc"]["backendRefs"][0]["port"] == 9001  # GATEWAY_LISTEN's port


def test_the_extension_policy_asks_what_the_rendered_ext_proc_does() -> None:
    rendered = _rendered_filters()["envoy.filters.http.ext_proc"]
    (ext_proc,) = _policy("EnvoyExtensionPolicy")["extProc"]
    assert ext_proc["failOpen"] is rendered["failure_mode_allow"] is False
    assert ext_proc.get("statusOnError", 500) == _STATUS[rendered["status_on_error"]["code"]]
    assert _seconds(ext_proc["messageTimeout"]) == _seconds(rendered["message_timeout"])
    mode, want = ext_proc["processingMode"], rendered["processing_mode"]
    assert mode["request"]["body"] == _MODES[want["request_body_mode"]]
    assert mode["response"]["body"] == _MODES[want["response_body_mode"]]
    # Envoy Gateway sends a direction's headers whenever the policy names that direction:
    # response headers, as the rendered filter sends them (an answer with no body still
    # opens a stream; the rendered API POST routes' SKIP has no counterpart there)
    assert want["response_header_mode"] == "SEND"
    assert mode["request"].get("attributes") == rendered["request_attributes"]
    assert mode["response"].get("attributes") == rendered["response_attributes"]
    options = rendered["metadata_options"]
    assert ext_proc["metadata"]["accessibleNamespaces"] == \
        options["forwarding_namespaces"]["untyped"]
    assert ext_proc["metadata"]["writableNamespaces"] == options["receiving_namespaces"]["untyped"]


def _render_command_in(name: str) -> list[str]:
    """The `gateway envoy-config ...` command an example's header comment tells the reader to
    render its bootstrap with (continued over `#` lines ending in a backslash)."""
    words: list[str] = []
    text = (DEPLOY / name).read_text()
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("# ").split("(")[0].strip()  # not a trailing "(why)"
        if words or "gateway envoy-config" in body:
            if not words:
                body = body[body.index("gateway envoy-config"):]
            words += body.rstrip("\\").split()
            if not body.endswith("\\"):
                break
    assert words[:2] == ["gateway", "envoy-config"], name
    return words[2:]


def test_the_pods_envoy_is_rendered_to_listen_where_its_service_sends(
        capsys: pytest.CaptureFixture[str]) -> None:
    """sidecar-with-envoy.yaml's Envoy is reached through its containerPort, from the pod's
    network: the bootstrap its comment renders must listen there, not on loopback (the
    renderer's default, 127.0.0.1:10000, which no Service can reach)."""
    from gateway.cli import main

    name = "sidecar-with-envoy.yaml"
    assert main(["envoy-config", *_render_command_in(name)]) == 0
    listener = yaml.safe_load(capsys.readouterr().out)["static_resources"]["listeners"][0]
    address = listener["address"]["socket_address"]
    deployment = next(d for d in yaml.safe_load_all((DEPLOY / name).read_text())
                      if d and d["kind"] == "Deployment")
    envoy = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "envoy")
    assert address["port_value"] == envoy["ports"][0]["containerPort"]
    assert not address["address"].startswith("127."), address
