"""The chart's Grafana dashboard and PrometheusRule, rendered by the real Helm of
tests/test_helm_chart.py: the ConfigMap the Grafana sidecar loads, the rules' shape and
values, and every query and alert expression parsed by a PromQL parser (`promql-parser`,
the Rust parser Prometheus-compatible databases use, with Prometheus's function list) and
checked to use only series a running supervisor really exports, so that a renamed metric
breaks this test rather than the dashboard."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import helm_python as helm
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from host_monitor.metrics import HeartbeatCounts, HostMonitorMetrics, PeerCounts
from tests.conftest import SettingsFactory
from tests.test_helm_chart import (
    CHART,
    FULLNAME,
    K8S_VERSION,
    NAMESPACE,
    POSTGRES,
    find,
    kinds,
    merged,
    render,
)
from tests.test_job_metrics import drive, scrape, served, settings_for_metrics

ENABLED: dict[str, Any] = merged(
    POSTGRES, {"grafana": {"dashboard": {"enabled": True}}, "prometheusRule": {"enabled": True}}
)
# What Grafana puts in a query before sending it, as a parser-ready stand-in.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$namespace": ".*",
    "$job_name": ".*",
}
#: The series of a family of each type, by suffix.
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}
LABEL_VALUES = re.compile(r"^label_values\((?P<query>.+),\s*(?P<label>\w+)\)$")


@pytest.fixture
async def exported(make_settings: SettingsFactory) -> AsyncIterator[set[str]]:
    """Names of the series a supervisor exports once it has seen a job train, fail, be
    healed and restarted (every per-job series has samples then)."""
    async with served(settings_for_metrics(make_settings)) as (api, _):
        await drive(api)
        await scrape(api)
        supervisor = exported_names((await api.client.get("/metrics")).text)
    yield supervisor | host_monitor_names()


def host_monitor_names() -> set[str]:
    """The series a host monitor exports (its /metrics, scraped by the PodMonitor), every
    part of it on."""
    metrics = HostMonitorMetrics("n1")
    metrics.sources.heartbeats = lambda: HeartbeatCounts(3, 1, 0, 1.0)
    metrics.sources.watchdogs = lambda: {"xid watchdog": True}
    metrics.sources.worker_starts = lambda: 2
    metrics.sources.worker_states = lambda: ["running"]
    metrics.sources.peer = lambda: PeerCounts({"sent": 10}, {"sent": 0.5})
    metrics.emergency_round(1.0)
    return exported_names(metrics.render().decode())


def exported_names(exposition: str) -> set[str]:
    """Each series name of a /metrics text: those with samples, and those a family
    declares (a labelled counter that has counted nothing yet has no sample)."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """The series selectors of a PromQL expression; raises ValueError if it does not parse
    (unbalanced brackets, an unknown function, a bad matcher or duration...)."""
    found: list[promql_parser.VectorSelector] = []

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    assert found, f"no series in {expr!r}"
    return found


def grafana_query(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable the test does not know in {expr!r}"
    return expr


def test_the_parser_refuses_what_promtool_would() -> None:
    for bad in (
        "sum(rate(supervisor_actions_total[5m])",
        "rate(supervisor_actions_total[5m]]",
        'supervisor_leader{namespace="x"',
        "rates(supervisor_actions_total[5m])",
        "rate(supervisor_actions_total[5 minutes])",
        "supervisor_leader ==",
    ):
        with pytest.raises(ValueError):
            selectors(bad)


def test_chart_with_dashboard_and_rules_lints_clean_in_strict_mode() -> None:
    report = helm.lint(CHART, ENABLED, strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- the dashboard ---------------------------------------------------------------------------


def dashboard_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    config_map = find(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    (text,) = config_map["data"].values()
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar() -> None:
    assert not any(d["metadata"]["name"].endswith("-dashboard") for d in render(POSTGRES))
    docs = render(ENABLED)
    config_map = find(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    dashboard = dashboard_of(docs)
    assert dashboard["uid"] == "resiliency-supervisor"
    titles = {p["title"] for p in dashboard["panels"] if p["type"] != "row"}
    assert {
        "Goodput",
        "Last step",
        "Step time",
        "Restarts by kind",
        "Emergency checkpoints",
        "Time to recover",
        "Spares available",
        "Nodes",
        "Heartbeats",
        "Action outcomes",
        "Policy errors",
        "Leader",
    } <= titles
    # Another sidecar's label and a folder.
    custom = render(
        merged(
            ENABLED,
            {
                "grafana": {
                    "dashboard": {
                        "label": "team_dashboards",
                        "labelValue": "ml",
                        "annotations": {"grafana_folder": "Training"},
                    }
                }
            },
        )
    )
    metadata = find(custom, "ConfigMap", f"{FULLNAME}-dashboard")["metadata"]
    assert metadata["labels"]["team_dashboards"] == "ml"
    assert "grafana_dashboard" not in metadata["labels"]
    assert metadata["annotations"] == {"grafana_folder": "Training"}


def test_dashboard_queries_parse_and_use_only_exported_series(exported: set[str]) -> None:
    dashboard = dashboard_of(render(ENABLED))
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) >= 12
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["definition"])
            assert match is not None, variable
            queries.append(match["query"])
    for query in queries:
        for selector in selectors(grafana_query(query)):
            assert selector.name in exported, f"{selector.name} (in {query!r}) is not exported"
    # Every per-job panel follows the job picker.
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if "supervisor_job_" in target["expr"]:
                assert 'job_name=~"$job_name"' in target["expr"], target["expr"]


# --- the alerting rules ------------------------------------------------------------------------


def rules_of(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rule = find(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    (group,) = rule["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def test_each_alert_is_complete_parses_and_uses_only_exported_series(
    exported: set[str],
) -> None:
    assert "PrometheusRule" not in kinds(render(POSTGRES))
    rules = rules_of(render(ENABLED))
    assert set(rules) == {
        "TrainingJobStalled",
        "TrainingJobCheckpointStale",
        "TrainingJobCheckpointSavesFailing",
        "TrainingJobGoodputLow",
        "TrainingJobRestartBudgetSpent",
        "SupervisorNoSpareNode",
        "SupervisorNoLeader",
        "SupervisorHeartbeatsRejected",
        "HostMonitorHeartbeatsFailing",
    }
    for name, rule in rules.items():
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"], name
        promql_parser.parse_duration(rule["for"])
        for selector in selectors(rule["expr"]):
            assert selector.name in exported, f"{name}: {selector.name} is not exported"
            # Each selects this release's series only.
            matchers = {(m.name, m.value) for m in selector.matchers.matchers}
            assert ("namespace", NAMESPACE) in matchers, f"{name}: {rule['expr']}"
        # Alertmanager's templates in the annotations are left to it by Helm.
        assert not any("<no value>" in text for text in rule["annotations"].values())
        if "supervisor_job_" in rule["expr"]:
            assert "{{ $labels.job_name }}" in rule["annotations"]["summary"], name


def test_thresholds_durations_and_severities_come_from_values() -> None:
    values = merged(
        ENABLED,
        {
            "prometheusRule": {
                "selector": 'service="rs-supervisor"',
                "labels": {"release": "prom"},
                "jobStalled": {"stalledAfterS": 1200, "for": "3m", "severity": "page"},
                "goodputLow": {"threshold": 0.65, "for": "1h"},
                "heartbeatsRejected": {"threshold": 0.5},
                "noSpare": {"enabled": False},
            }
        },
    )
    docs = render(values)
    assert find(docs, "PrometheusRule")["metadata"]["labels"]["release"] == "prom"
    rules = rules_of(docs)
    assert "SupervisorNoSpareNode" not in rules
    stalled = rules["TrainingJobStalled"]
    assert "> 1200" in stalled["expr"] and stalled["for"] == "3m"
    assert stalled["labels"]["severity"] == "page"
    assert "< 0.65" in rules["TrainingJobGoodputLow"]["expr"]
    assert rules["TrainingJobGoodputLow"]["for"] == "1h"
    assert rules["SupervisorHeartbeatsRejected"]["expr"].endswith("> 0.5")
    for rule in rules.values():
        for selector in selectors(rule["expr"]):
            matchers = {(m.name, m.value) for m in selector.matchers.matchers}
            assert ("service", "rs-supervisor") in matchers, rule["expr"]


# --- the documentation -----------------------------------------------------------------------


def test_readme_lists_each_per_job_series_and_only_exported_ones(exported: set[str]) -> None:
    readme = (CHART.parent.parent / "docs" / "dashboard-and-metrics.md").read_text()
    section = readme.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(supervisor_\w+)` \|", section, re.MULTILINE))
    for name in listed:
        assert name in exported or f"{name}_count" in exported, name
    per_job = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in exported}
    per_job = {n for n in per_job if n.startswith("supervisor_job_")}
    assert per_job - {n.removesuffix("_total") for n in listed} == set()


def test_host_monitors_are_scraped_with_their_own_token() -> None:
    docs = render(merged(POSTGRES, {"serviceMonitor": {"enabled": True}}))
    monitor = find(docs, "PodMonitor", f"{FULLNAME}-host-monitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    secret = endpoint["bearerTokenSecret"]
    assert secret["key"] == "host-monitor-metrics-token"
    tokens = find(docs, "Secret", secret["name"])
    assert "host-monitor-metrics-token" in tokens["data"]
    daemonset = find(docs, "DaemonSet", f"{FULLNAME}-host-monitor")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    ref = env["HOST_MONITOR_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["name"], "host-monitor-metrics-token")
    assert "PodMonitor" not in kinds(render(POSTGRES))
