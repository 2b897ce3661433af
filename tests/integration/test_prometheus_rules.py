"""deploy/prometheus-rules.yaml: a rules file plain Prometheus loads (its structure), whose
runbooks are anchors of docs/operations.md, and whose every metric and label is one a real
process shows: the sidecar's `/metrics` (`gateway serve`, Redis mode), its Envoy's
`/stats/prometheus` and the syncer's (`gateway policy sync --metrics-listen`). A renamed
metric or label fails here, not silently in production."""

from __future__ import annotations

import re
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devspoke.envoy_proc import envoy_service
from devspoke.procs import LOOPBACK, Service, free_port, tansu_service
from gateway.cli import main
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from tests.integration.test_serve import SECRET, _door_code, _policy, _sidecar, _until
from tests.unit.test_doc_links import slugs

ROOT = Path(__file__).parents[2]
RULES = ROOT / "deploy" / "prometheus-rules.yaml"
OPS = ROOT / "docs" / "operations.md"

METRIC = re.compile(r"\b((?:gateway|envoy)_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.M)
TARGET_LABELS = {"instance", "job"}  # Prometheus attaches them at scrape
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"),
            "summary": ("", "_count", "_sum"), "unknown": ("",)}
# Which processes' pages each group's rules read
SOURCES = {"gateway-sidecar": ("sidecar", "envoy"), "gateway-spoke-sync": ("syncer",)}


def _rules() -> list[tuple[str, dict[str, Any]]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(g["name"], r) for g in doc["groups"] for r in g["rules"]]


def _anchors(path: Path) -> set[str]:
    """Heading slugs, and the `<a id>` anchors of the alerts table's rows."""
    return slugs(path) | set(re.findall(r'<a id="([^"]+)"></a>', path.read_text()))


def test_the_rules_file_is_well_formed_and_each_alert_has_a_runbook() -> None:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    assert {g["name"] for g in doc["groups"]} == set(SOURCES)
    rules = _rules()
    names = [r["alert"] for _, r in rules]
    assert len(names) == len(set(names)), names
    anchors = _anchors(OPS)
    table = OPS.read_text().split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    bad = []
    for _, r in rules:
        name = r.get("alert", "?")
        ann, labels = r.get("annotations", {}), r.get("labels", {})
        if set(r) - {"alert", "expr", "for", "labels", "annotations"}:
            bad.append(f"{name}: keys {sorted(r)}")
        if not re.fullmatch(r"Gateway[A-Z][A-Za-z]+", name):
            bad.append(f"{name}: not a GatewayCamelCase name")
        if not re.fullmatch(r"\d+[smh]", str(r.get("for", ""))):
            bad.append(f"{name}: for {r.get('for')!r}")
        if labels.get("severity") not in ("page", "ticket"):
            bad.append(f"{name}: severity {labels.get('severity')!r}")
        if not ann.get("summary") or len(ann.get("description", "")) < 80:
            bad.append(f"{name}: no summary, or no description saying what to do")
        url = ann.get("runbook_url", "")
        file, _, anchor = url.partition("#")
        if file != "docs/operations.md" or anchor not in anchors:
            bad.append(f"{name}: runbook_url {url!r} is no anchor of docs/operations.md")
        if f"`{name}`" not in table:
            bad.append(f"{name}: not in docs/operations.md's Alerts table")
        expr = str(r.get("expr", ""))
        if not METRIC.search(expr) and "up{" not in expr:
            bad.append(f"{name}: expr names no metric")
        try:  # Prometheus's own grammar (promql-parser: the Rust port Greptime maintains)
            promql_parser.parse(expr)
        except Exception as exc:
            bad.append(f"{name}: not PromQL ({exc}): {expr!r}")
    assert not bad, bad
    assert len(rules) == table.count("| <a id=")  # no row for an alert that is gone


def exposed(text: str) -> dict[str, set[str]]:
    """Each series name a page shows (as Prometheus stores it) -> its label names. A family
    with no series yet (a labelled counter nothing has counted) shows its names by type,
    without labels: a rule that matches on its labels then fails, and says why."""
    names = set(SERIES.findall(text))
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        labels = {k for s in fam.samples for k in s.labels} - {"le", "quantile"}
        # the parser names an Envoy counter's samples `_total`; the page (and Prometheus)
        # does not: only the names the page shows count
        shown = ({s.name for s in fam.samples} | {fam.name}) & names
        if not fam.samples:
            shown = {fam.name + sfx for sfx in SUFFIXES[fam.type]}
        for n in shown:
            out[n] = labels
    return out


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


@pytest.fixture
def pages(tmp_path: Path, redis_url: str) -> Iterator[dict[str, dict[str, set[str]]]]:
    """The /metrics of a real sidecar (a request allowed, one denied), of a real syncer,
    and Envoy's /stats/prometheus after one request (its records' logger made)."""
    started: list[Service] = []
    try:
        (tmp_path / "p.yaml").write_text(_policy())
        assert main(["policy", "apply", str(tmp_path / "p.yaml"), "--redis-url", redis_url]) == 0
        door = free_port()
        sidecar, mport = _sidecar(tmp_path, {
            "GATEWAY_REDIS_URL": redis_url, "GATEWAY_AUTHZ_HTTP_LISTEN": f"127.0.0.1:{door}",
            "GATEWAY_SPOOL_DIR": str(tmp_path / "spool")})
        started.append(sidecar)
        _until(lambda: httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code == 200, 10)
        assert _door_code(door, SECRET) == 200 and _door_code(door, "sk-wrong") == 401

        kafka = tansu_service(free_port(), tmp_path / "tansu").start()
        started.append(kafka)
        sport = free_port()
        syncer = Service("sync", [sys.executable, "-m", "gateway", "policy", "sync", "--id",
                                  "sync-1", "--metrics-listen", f"127.0.0.1:{sport}"],
                         sport, tmp_path, env={
                             "GATEWAY_KAFKA_BOOTSTRAP": kafka.address,
                             "GATEWAY_HUB_BOOTSTRAP": kafka.address,
                             "GATEWAY_KAFKA_IDEMPOTENCE": "false", "GATEWAY_SPOKE": "s1",
                             "GATEWAY_REDIS_URL": redis_url,
                             "GATEWAY_SYNC_STATE_DIR": str(tmp_path / "sync")}).start()
        started.append(syncer)
        sync_url = f"http://127.0.0.1:{sport}/metrics"
        _until(lambda: "\ngateway_quota_feed_up " in _get(sync_url), 30)

        listen, admin = free_port(), free_port()
        ports = EnvoyPorts(listen=f"{LOOPBACK}:{listen}", sidecar=f"{LOOPBACK}:{free_port()}",
                           engine=f"{LOOPBACK}:{free_port()}", admin=f"{LOOPBACK}:{admin}",
                           authz_http=f"{LOOPBACK}:{free_port()}")
        envoy = envoy_service(render(ports), admin, listen, tmp_path)
        started.append(envoy.start())
        httpx.get(f"http://{LOOPBACK}:{listen}/v1/models", timeout=5)  # 503: no sidecar there
        envoy_url = f"http://{LOOPBACK}:{admin}/stats/prometheus"
        _until(lambda: "_logs_dropped" in _get(envoy_url), 10)

        yield {"sidecar": exposed(_get(f"http://127.0.0.1:{mport}/metrics")),
               "syncer": exposed(_get(sync_url)), "envoy": exposed(_get(envoy_url))}
    finally:
        for svc in reversed(started):
            svc.stop()


def test_every_metric_and_label_of_the_rules_is_on_a_real_page(
        pages: dict[str, dict[str, set[str]]]) -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "gateway").rglob("*.py"))
    bad = []
    for group, r in _rules():
        shown: dict[str, set[str]] = {}
        for page in SOURCES[group]:
            shown.update(pages[page])
        expr, name = str(r["expr"]), r["alert"]
        used: set[str] = set(TARGET_LABELS)
        for metric, braces in METRIC.findall(expr):
            if metric not in shown:
                bad.append(f"{name}: {metric} is on no page of {SOURCES[group]}")
                continue
            used |= shown[metric]
            for label, op, value in MATCHER.findall(braces):
                if label not in shown[metric] | TARGET_LABELS:
                    bad.append(f"{name}: {metric} has no label {label} "
                               f"(it has {sorted(shown[metric])})")
                elif op in ("=", "=~") and label not in TARGET_LABELS:
                    # a label value the gateway never writes would match nothing
                    bad += [f"{name}: {metric}{{{label}={v!r}}}: no such value in gateway/"
                            for v in value.split("|") if f'"{v}"' not in source]
        for grouping in GROUPING.findall(expr):
            bad += [f"{name}: by/without ({label}): no metric of it has that label"
                    for label in re.split(r"\s*,\s*", grouping.strip()) if label not in used]
    assert not bad, bad


def test_the_page_reader_keeps_the_names_the_page_shows() -> None:
    """The checks above read the page's own names: a metric the rules name but the page
    does not show (or shows under the parser's `_total` only) is missing."""
    page = exposed("# TYPE gateway_x_total counter\ngateway_x_total{a=\"1\"} 1.0\n"
                   "# TYPE envoy_y counter\nenvoy_y{} 0\n"
                   "# HELP gateway_z_total z\n# TYPE gateway_z_total counter\n")
    assert page == {"gateway_x_total": {"a"}, "envoy_y": set(), "gateway_z_total": set()}
