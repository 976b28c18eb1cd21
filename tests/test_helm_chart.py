"""The Helm chart, rendered and linted by a real Helm (Helm's Go SDK, through the
`helm-python-sdk` bindings: no cluster, no helm binary), checked object by object, against
the Kubernetes JSON schemas of a current release (`kubernetes-validate`, offline), and
against the supervisor's and the host monitor's own settings classes.

`make test` installs both (extra `deploy`). What is not run here: `helm install` into a
cluster (there is none), so `lookup` returns nothing and tokens are generated afresh on
every render (on a cluster they are read back from the Secret).
"""

from __future__ import annotations

import base64
import collections
import copy
import importlib.util
import json
import os
import re
import shlex
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from host_monitor.config import HostMonitorSettings
from supervisor.api.schemas import FaultIn
from supervisor.config import CONFIG_FILE_ENV, Settings, load_settings
from supervisor.controller import load_policy
from supervisor.kube import events as kube_events
from supervisor.kube import objects as kube_objects
from supervisor.policy import Policy
from training import worker_client

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "resiliency-supervisor"
K8S_VERSION = "1.37.0"  # the newest release kubernetes-validate ships schemas for
RELEASE, NAMESPACE = "rs", "training"
FULLNAME = f"{RELEASE}-resiliency-supervisor"
PG_URL = "postgresql+psycopg://supervisor:secret@db.example:5432/supervisor"
TOKENS = {
    "agentToken": "agent-token-0123456789",
    "operatorToken": "operator-token-0123456789",
    "actuatorToken": "actuator-token-0123456789",
    "workerToken": "worker-token-0123456789",
    "peerToken": "peer-token-0123456789",
    "metricsToken": "metrics-token-0123456789",
}
POSTGRES: dict[str, Any] = {"database": {"url": PG_URL}}
SQLITE: dict[str, Any] = {"database": {"type": "sqlite"}, "supervisor": {"replicas": 1}}
KUBE_IDENTITY: dict[str, Any] = {**POSTGRES, "hostMonitor": {"identity": {"mode": "kubernetes"}}}
POLICY_SOURCE = """
from supervisor.domain import EventType
from supervisor.policy import Policy, actions, handles


class CordonOnXid(Policy):
    @handles(EventType.GPU_XID)
    def on_xid(self, event, ctx):
        return [actions.cordon(event.node, reason="xid")]
"""
INLINE_POLICY: dict[str, Any] = {
    **POSTGRES,
    "policy": {"inline": POLICY_SOURCE, "className": "CordonOnXid"},
}
CERT_MANAGER: dict[str, Any] = {
    **POSTGRES,
    "tls": {"enabled": True, "certManager": {"issuerRef": {"name": "team-ca"}}},
}
EXISTING_TLS: dict[str, Any] = {**POSTGRES, "tls": {"enabled": True, "existingSecret": "rs-tls"}}
# The shadow supervisor: a supervisor in dry run beside the acting one.
SHADOW = f"{FULLNAME}-shadow"
RELAY = f"{FULLNAME}-heartbeat-relay"
SHADOW_POLICY = "policies.examples.periodic_checkpoints_only:PeriodicCheckpointsOnly"
SHADOW_ON: dict[str, Any] = {**POSTGRES, "shadow": {"enabled": True}}
# The parameter names users of Google's resiliency supervisor know.
STANDARD_NAMES = [
    "heartbeat_polling_period_s",
    "heartbeat_timeout_s",
    "pod_termination_threshold_s",
    "jobset_downtime_threshold_s",
    "enable_fault_injection",
    "num_dp_replicas",
    "num_nodes_per_dp",
    "max_workload_restarts",
    "max_in_job_restarts",
    "min_num_dp_replicas",
    "max_num_dp_replicas",
    "enable_workload_scaling",
]


# --- rendering --------------------------------------------------------------------------------


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layer in layers:
        _merge_into(out, copy.deepcopy(layer))
    return out


def _merge_into(base: dict[str, Any], layer: dict[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge_into(base[key], value)
        else:
            base[key] = value


def render_files(values: dict[str, Any], namespace: str = NAMESPACE) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=namespace, is_install=True)


def render(values: dict[str, Any], namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    docs = []
    for path, text in sorted(render_files(values, namespace).items()):
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def container(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    (only,) = pod["containers"]
    result: dict[str, Any] = only
    return result


def secret_value(docs: list[dict[str, Any]], name: str, key: str) -> str:
    secret = find(docs, "Secret", name)
    return base64.b64decode(secret["data"][key]).decode()


def resolve_env(docs: list[dict[str, Any]], env: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet would build it from these objects."""
    fields = {
        "metadata.name": f"{FULLNAME}-5d8f7-abcde",
        "spec.nodeName": "gpu-node-1",
        "status.podIP": "10.4.0.7",
    }
    out = {}
    for var in env:
        if "value" in var:
            out[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            out[var["name"]] = secret_value(docs, ref["name"], ref["key"])
        else:
            out[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
    return out


def supervisor_settings(
    docs: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str = FULLNAME,
) -> Settings:
    """Load the rendered settings file and environment with the supervisor's own loader:
    of the Deployment `name` (FULLNAME, SHADOW)."""
    deployment = find(docs, "Deployment", name)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    configmap = volumes["settings"]["configMap"]["name"]
    assert configmap == f"{deployment['metadata']['name']}-settings"
    settings_yaml = find(docs, "ConfigMap", configmap)["data"]["settings.yaml"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "settings.yaml"
    path.write_text(settings_yaml)
    c = container(docs, "Deployment", name)
    assert c["command"] == [
        "supervisor",
        "serve",
        "--config",
        "/etc/resiliency-supervisor/settings.yaml",
    ]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/resiliency-supervisor/settings.yaml"]["subPath"] == "settings.yaml"
    for name in [k for k in os.environ if k.startswith("SUPERVISOR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_FILE_ENV, str(path))  # restored after the test
    for name, value in resolve_env(docs, c["env"]).items():
        monkeypatch.setenv(name, value)
    return load_settings(path)


# --- lint, schema -----------------------------------------------------------------------------


def test_chart_lints_clean_in_strict_mode() -> None:
    shadow = merged(CERT_MANAGER, SHADOW_ON, {"shadow": {"policy": SHADOW_POLICY}})
    for values in (POSTGRES, SQLITE, INLINE_POLICY, CERT_MANAGER, EXISTING_TLS, shadow):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{K8S_VERSION}")
        assert report["errors"] == []
        # Only the "icon is recommended" hint may remain.
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"config": {"heartbeat_timout_s": 30}}, "additional properties 'heartbeat_timout_s'"),
        ({"supervisr": {"replicas": 3}}, "additional properties 'supervisr'"),
        ({"supervisor": {"replicas": "two"}}, "/supervisor/replicas"),
        ({"config": {"heartbeat_timeout_s": -1}}, "/config/heartbeat_timeout_s"),
        ({"config": {"log_level": "verbose"}}, "/config/log_level"),
        ({"config": {"enable_fault_injection": "yes"}}, "/config/enable_fault_injection"),
        ({"hostMonitor": {"kernelLog": {"source": "dmesg"}}}, "/hostMonitor/kernelLog/source"),
        ({"database": {"type": "mysql"}}, "/database/type"),
        ({"database": {"url": "mysql://x"}}, "/database/url"),
        ({"policy": {"module": "not a module"}}, "/policy/module"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"tls": {"enabeld": True}}, "additional properties 'enabeld'"),
        ({"tls": {"certManager": {"duration": "90d"}}}, "/tls/certManager/duration"),
        ({"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "/tls/certManager/issuerRef"),
        ({"shadow": {"enabeld": True}}, "additional properties 'enabeld'"),
        ({"shadow": {"policy": "not a module"}}, "/shadow/policy"),
        (
            {"shadow": {"settings": {"heartbeat_timout_s": 30}}},
            "additional properties 'heartbeat_timout_s'",
        ),
        ({"shadow": {"settings": {"heartbeat_timeout_s": -1}}}, "/shadow/settings"),
        ({"shadow": {"database": {"url": "mysql://x"}}}, "/shadow/database/url"),
    ],
)
def test_schema_rejects_bad_values_at_install_and_lint(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(merged(POSTGRES, values))
    report = helm.lint(CHART, merged(POSTGRES, values))
    assert any(message in e for e in report["errors"]), report


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "database.type postgresql needs database.url or database.existingSecret"),
        ({"database": {"type": "sqlite"}}, "database.type sqlite serves one replica"),
        (
            merged(POSTGRES, {"supervisor": {"leaderElection": False}}),
            "supervisor.replicas > 1 needs supervisor.leaderElection",
        ),
        (
            merged(POSTGRES, {"policy": {"inline": POLICY_SOURCE}}),
            "policy.className is required",
        ),
        (
            merged(POSTGRES, {"tls": {"enabled": True}}),
            "tls.enabled needs tls.existingSecret or tls.certManager.issuerRef.name",
        ),
        (
            merged(SHADOW_ON, {"shadow": {"settings": {"dry_run": False}}}),
            "shadow.settings.dry_run: the shadow always runs in dry run",
        ),
        (
            merged(SHADOW_ON, {"serviceAccount": {"name": SHADOW}}),
            f"serviceAccount.name {SHADOW} is the shadow's ServiceAccount",
        ),
        (
            merged(SHADOW_ON, {"shadow": {"database": {"url": PG_URL}}}),
            "shadow.database is the acting supervisor's database",
        ),
        (
            merged(SHADOW_ON, {"shadow": {"database": {"existingSecret": f"{FULLNAME}-database"}}}),
            "shadow.database is the acting supervisor's database",
        ),
        (
            merged(
                SHADOW_ON,
                {
                    "database": {"url": "", "existingSecret": "pg", "existingSecretKey": "dsn"},
                    "shadow": {"database": {"existingSecret": "pg", "existingSecretKey": "dsn"}},
                },
            ),
            "shadow.database is the acting supervisor's database",
        ),
    ],
)
def test_combinations_the_schema_cannot_express_fail_with_what_to_change(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


def test_config_schema_is_the_supervisors_own() -> None:
    """Each `config` value has the supervisor's type, bounds and default, and the names
    users know are all there."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config_schema = schema["properties"]["config"]
    assert config_schema["additionalProperties"] is False
    settings_schema = Settings.model_json_schema()["properties"]
    assert set(config_schema["properties"]) == set(values["config"])
    for name, prop in config_schema["properties"].items():
        assert name in Settings.model_fields, name
        expected = {k: v for k, v in settings_schema[name].items() if k != "title"}
        assert prop == expected, name
        assert values["config"][name] == Settings.model_fields[name].default, name
    assert set(STANDARD_NAMES) <= set(values["config"])
    # The chart sets these itself; a value for them would be ignored or conflict.
    managed = {"backend", "host", "port", "database_url", "policy", "kube_namespace"}
    managed |= {"log_format"}  # the top-level logFormat
    managed |= {"agent_token", "operator_token", "host_monitor_actuator_token"}
    managed |= {"leader_election", "host_monitor_port", "leader_election_identity"}
    assert not managed & set(values["config"])


# --- Kubernetes schemas -----------------------------------------------------------------------

INFRA_AFFINITY: dict[str, Any] = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "infra", "operator": "Exists"}]}]
        }
    }
}

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": POSTGRES,
    "sqlite": SQLITE,
    "inline-policy": INLINE_POLICY,
    "everything-else": merged(
        POSTGRES,
        {
            "workloadNamespace": "jobs",
            "database": {"url": "", "existingSecret": "db", "existingSecretKey": "dsn"},
            "auth": TOKENS,
            "policy": {"existingConfigMap": "my-policy", "className": "MyPolicy"},
            "hostMonitor": {"kernelLog": {"source": "file"}, "runtimeClassName": "nvidia"},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "grafana": {"dashboard": {"enabled": True}},
            "prometheusRule": {"enabled": True},
            "supervisor": {"replicas": 3, "service": {"type": "NodePort"}},
            "imagePullSecrets": [{"name": "regcred"}],
        },
    ),
    "no-kernel-log": merged(POSTGRES, {"hostMonitor": {"kernelLog": {"source": "off"}}}),
    "kube-identity": KUBE_IDENTITY,
    "tls-cert-manager": merged(CERT_MANAGER, {"serviceMonitor": {"enabled": True}}),
    "tls-existing-secrets": merged(
        EXISTING_TLS, {"tls": {"hostMonitorExistingSecret": "rs-host-monitor-tls"}}
    ),
    "shadow": merged(KUBE_IDENTITY, INLINE_POLICY, SHADOW_ON),
    "shadow-everything": merged(
        CERT_MANAGER,
        SHADOW_ON,
        {
            "workloadNamespace": "jobs",
            "imagePullSecrets": [{"name": "regcred"}],
            "shadow": {
                "policy": SHADOW_POLICY,
                "settings": {"heartbeat_timeout_s": 30.0},
                "database": {"url": "postgresql+psycopg://shadow:secret@db.example:5432/shadow"},
                "nodeSelector": {"pool": "infra"},
                "tolerations": [{"key": "infra", "operator": "Exists"}],
                "affinity": INFRA_AFFINITY,
                "podAnnotations": {"team": "ml"},
            },
        },
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_are_valid_kubernetes_objects(variant: str) -> None:
    docs = render(VARIANTS[variant])
    assert docs
    for doc in docs:
        if doc["apiVersion"] in ("monitoring.coreos.com/v1", "cert-manager.io/v1"):
            continue  # CRDs: see test_service_monitor, test_helm_monitoring.py, the TLS tests
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at {exc.path}")
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_validation_does_catch_an_invalid_object() -> None:
    """The schema check is real: a misspelt field of a rendered object is refused."""
    deployment = find(render(POSTGRES), "Deployment", FULLNAME)
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# --- RBAC -------------------------------------------------------------------------------------

ROLE_RULES = [
    {
        "apiGroups": ["jobset.x-k8s.io"],
        "resources": ["jobsets"],
        "verbs": ["get", "list", "watch", "patch", "create", "delete"],
    },
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["list", "watch", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "delete"]},
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": ["LEASE"],
        "verbs": ["get", "update"],
    },
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "get"]},
]
NODE_EVENT_RULES = [{"apiGroups": [""], "resources": ["events"], "verbs": ["create", "get"]}]
# The Kubernetes client's methods the backend may call, and the permission each needs.
# A list also serves watches (the informers list, then watch).
CLIENT_CALLS: dict[str, list[tuple[str, str, str]]] = {
    "get_namespaced_custom_object": [("jobset.x-k8s.io", "jobsets", "get")],
    "list_namespaced_custom_object": [
        ("jobset.x-k8s.io", "jobsets", "list"),
        ("jobset.x-k8s.io", "jobsets", "watch"),
    ],
    "patch_namespaced_custom_object": [("jobset.x-k8s.io", "jobsets", "patch")],
    "create_namespaced_custom_object": [("jobset.x-k8s.io", "jobsets", "create")],
    "delete_namespaced_custom_object": [("jobset.x-k8s.io", "jobsets", "delete")],
    "read_namespaced_job": [("batch", "jobs", "get")],
    "list_namespaced_job": [("batch", "jobs", "list"), ("batch", "jobs", "watch")],
    "delete_namespaced_job": [("batch", "jobs", "delete")],
    "read_namespaced_pod": [("", "pods", "get")],
    "list_namespaced_pod": [("", "pods", "list"), ("", "pods", "watch")],
    "patch_namespaced_pod": [("", "pods", "patch")],
    "patch_namespaced_pod_status": [("", "pods/status", "patch")],
    "delete_namespaced_pod": [("", "pods", "delete")],
    "create_namespaced_pod_eviction": [("", "pods/eviction", "create")],
    "read_namespaced_lease": [("coordination.k8s.io", "leases", "get")],
    "create_namespaced_lease": [("coordination.k8s.io", "leases", "create")],
    "replace_namespaced_lease": [("coordination.k8s.io", "leases", "update")],
    "patch_namespaced_lease": [("coordination.k8s.io", "leases", "patch")],
    "delete_namespaced_lease": [("coordination.k8s.io", "leases", "delete")],
    "create_namespaced_event": [("", "events", "create")],
    "read_namespaced_event": [("", "events", "get")],
    "patch_namespaced_event": [("", "events", "patch")],
    "read_node": [("", "nodes", "get")],
    "list_node": [("", "nodes", "list"), ("", "nodes", "watch")],
    "patch_node": [("", "nodes", "patch")],
    "create_token_review": [("authentication.k8s.io", "tokenreviews", "create")],
}
API_CALL = re.compile(
    r"\b(?:read|list|create|patch|replace|delete|get)_"
    r"(?:namespaced_\w+|node\w*|cluster_custom_object|custom_object|token_review)\b"
)


def test_rbac_grants_exactly_what_the_kubernetes_backend_calls() -> None:
    """Every client call in supervisor/kube is allowed, and nothing else is."""
    needed: set[tuple[str, str, str]] = set()
    for path in sorted((ROOT / "supervisor" / "kube").glob("*.py")):
        for call in API_CALL.findall(path.read_text()):
            assert call in CLIENT_CALLS, f"{path.name} calls {call}: add it here and to the chart"
            needed |= set(CLIENT_CALLS[call])
    assert needed, "no Kubernetes call found: the scan is broken"
    docs = render(KUBE_IDENTITY)  # TokenReviews: only with hostMonitor.identity kubernetes

    def granted(*roles: dict[str, Any]) -> set[tuple[str, str, str]]:
        return {
            (group, resource, verb)
            for role in roles
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }

    main = granted(
        find(docs, "Role", FULLNAME),
        find(docs, "ClusterRole", f"{NAMESPACE}-{FULLNAME}-nodes"),
        find(docs, "ClusterRole", f"{NAMESPACE}-{FULLNAME}-tokenreviews"),
    )
    assert needed - main == set(), "the backend would be refused these"
    assert main - needed == set(), "granted but never used"
    # Events about nodes go where the backend records them, with the same verbs.
    node_events = find(docs, "Role", f"{FULLNAME}-node-events")
    assert node_events["metadata"]["namespace"] == kube_events.NODE_EVENT_NAMESPACE
    assert granted(node_events) == {n for n in needed if n[1] == "events"}


@pytest.mark.parametrize(
    ("values", "workload_ns", "lease"),
    [
        (POSTGRES, NAMESPACE, "resiliency-supervisor"),
        (merged(POSTGRES, {"workloadNamespace": "default"}), "default", "resiliency-supervisor"),
        (
            merged(
                POSTGRES,
                {"workloadNamespace": "jobs", "config": {"leader_election_lease_name": "rs-a"}},
            ),
            "jobs",
            "rs-a",
        ),
    ],
)
def test_rbac_is_exactly_the_least_that_works(
    values: dict[str, Any], workload_ns: str, lease: str
) -> None:
    docs = render(values)
    role = find(docs, "Role", FULLNAME)
    assert role["metadata"]["namespace"] == workload_ns
    expected = json.loads(json.dumps(ROLE_RULES).replace("LEASE", lease))
    assert role["rules"] == expected
    roles = sorted(d["metadata"]["name"] for d in docs if d["kind"] in ("Role", "RoleBinding"))
    if workload_ns == "default":  # the Role there already covers events about nodes
        assert roles == [FULLNAME, FULLNAME]
    else:
        node_events = find(docs, "Role", f"{FULLNAME}-node-events")
        assert node_events["metadata"]["namespace"] == "default"
        assert node_events["rules"] == NODE_EVENT_RULES
        node_binding = find(docs, "RoleBinding", f"{FULLNAME}-node-events")
        assert node_binding["metadata"]["namespace"] == "default"
        assert node_binding["roleRef"]["name"] == node_events["metadata"]["name"]
        assert node_binding["subjects"] == [
            {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
        ]
    cluster_role = find(docs, "ClusterRole")
    # Cluster-wide: nodes, and nothing else.
    assert cluster_role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]}
    ]
    assert cluster_role["metadata"]["name"] == f"{NAMESPACE}-{FULLNAME}-nodes"
    sa = find(docs, "ServiceAccount", FULLNAME)
    subject = {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
    binding = find(docs, "RoleBinding", FULLNAME)
    assert binding["metadata"]["namespace"] == workload_ns
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [subject]
    cluster_binding = find(docs, "ClusterRoleBinding")
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert cluster_binding["subjects"] == [subject]
    pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    # The lease the supervisor uses is the one the Role lets it renew, in that namespace.
    settings = yaml.safe_load(
        find(docs, "ConfigMap", f"{FULLNAME}-settings")["data"]["settings.yaml"]
    )
    assert settings["leader_election_lease_name"] == lease
    assert settings["kube_namespace"] == workload_ns


def test_rbac_can_be_left_to_the_cluster_admin() -> None:
    docs = render(
        merged(
            POSTGRES,
            {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "given"}},
        )
    )
    assert not {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "ServiceAccount"} & {
        d["kind"] for d in docs if d["metadata"]["name"] not in (f"{FULLNAME}-host-monitor", RELAY)
    }
    assert (
        find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["serviceAccountName"]
        == "given"
    )


# --- the supervisor Deployment ----------------------------------------------------------------


def test_supervisor_deployment_is_ha_probed_bounded_and_locked_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(POSTGRES)
    deployment = find(docs, "Deployment", FULLNAME)
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "Recreate"}
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = container(docs, "Deployment", FULLNAME)
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # The probes hit the port the supervisor binds.
    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    assert (settings.host, settings.port) == ("0.0.0.0", 8080)
    assert settings.leader_election is True
    assert settings.leader_election_identity == f"{FULLNAME}-5d8f7-abcde"  # the pod name
    assert settings.backend == "kubernetes"
    # /tmp is the only writable path with PostgreSQL.
    assert [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")] == ["/tmp"]

    service = find(docs, "Service", FULLNAME)
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"

    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    # Standbys are never ready: they must stay evictable.
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_rendered_settings_are_accepted_by_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {
        "heartbeat_polling_period_s": 2.5,
        "heartbeat_timeout_s": 9.0,
        "hang_timeout_s": 120.0,
        "num_dp_replicas": 8,
        "max_num_dp_replicas": 8,
        "num_nodes_per_dp": 2,
        "max_workload_restarts": 2,
        "max_in_job_restarts": 1,
        "enable_fault_injection": True,
        "enable_workload_scaling": True,
        "pod_termination_threshold_s": 90.0,
        "jobset_downtime_threshold_s": 240.0,
        "kube_jobset_selector": "team=llm",
        "history_retention_days": 7.0,
        "goodput_retention_days": 2.0,
        "log_level": "debug",
    }
    docs = render(merged(POSTGRES, {"config": config, "auth": TOKENS, "workloadNamespace": "jobs"}))
    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    for name, value in config.items():
        assert getattr(settings, name) == value, name
    assert settings.database_url == PG_URL
    assert settings.kube_namespace == "jobs"
    assert settings.policy == "policies.default:DefaultPolicy"
    assert settings.host_monitor_port == 9400
    assert settings.agent_token is not None and settings.operator_token is not None
    assert settings.agent_token.get_secret_value() == TOKENS["agentToken"]
    assert settings.operator_token.get_secret_value() == TOKENS["operatorToken"]
    assert settings.host_monitor_actuator_token is not None
    assert settings.host_monitor_actuator_token.get_secret_value() == TOKENS["actuatorToken"]


def test_a_setting_the_supervisor_rejects_cannot_slip_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relations between values (not expressible in the schema) are checked by the
    supervisor's loader on the rendered file: it refuses to start, naming the cause."""
    docs = render(merged(POSTGRES, {"config": {"heartbeat_timeout_s": 4.0}}))
    with pytest.raises(Exception, match="heartbeat_timeout_s must be greater"):
        supervisor_settings(docs, tmp_path, monkeypatch)


def test_notification_routes_reach_the_supervisor_with_secrets_from_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routes go into the settings file as they are; their secrets stay in a Secret,
    mounted read-only as files that the routes name."""
    secret_dir = "/etc/resiliency-supervisor/notifications"
    url_file = tmp_path / "slack-url"  # stands for the mounted key, read the same way
    url_file.write_text("https://hooks.slack.com/services/T/B/secret\n")
    routes = [
        {
            "name": "oncall",
            "sink": {"type": "slack", "url": {"file": str(url_file)}},
            "events": ["host_heartbeat_lost", "hang"],
            "actions": ["*"],
            "outcomes": ["failed"],
        }
    ]
    values = merged(
        POSTGRES,
        {
            "config": {"public_url": "https://supervisor.example", "notification_max_attempts": 8},
            "notifications": {"routes": routes, "existingSecret": "rs-notifications"},
        },
    )
    docs = render(values)
    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    (route,) = settings.notification_routes
    assert route.sink.url.get_secret_value() == "https://hooks.slack.com/services/T/B/secret"
    assert route.events == ["host_heartbeat_lost", "hang"] and route.outcomes == ["failed"]
    assert settings.public_url == "https://supervisor.example"
    assert settings.notification_max_attempts == 8
    pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "notification-secrets")
    assert volume["secret"] == {"secretName": "rs-notifications", "defaultMode": 0o440}
    (mount,) = [
        m
        for m in container(docs, "Deployment", FULLNAME)["volumeMounts"]
        if m["name"] == volume["name"]
    ]
    assert mount == {"name": volume["name"], "mountPath": secret_dir, "readOnly": True}
    # No secret, no volume; no routes, none sent.
    default = render(POSTGRES)
    assert "notification-secrets" not in json.dumps(find(default, "Deployment", FULLNAME))
    settings_yaml = find(default, "ConfigMap", f"{FULLNAME}-settings")["data"]["settings.yaml"]
    assert yaml.safe_load(settings_yaml)["notification_routes"] == []


def test_a_malformed_route_is_refused_at_install() -> None:
    bad = {"name": "hook", "sink": {"type": "teams", "url": "https://x"}}
    with pytest.raises(helm.HelmError, match="notifications"):
        render(merged(POSTGRES, {"notifications": {"routes": [bad]}}))


def test_settings_checksum_restarts_the_supervisor_on_change() -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = find(render(values), "Deployment", FULLNAME)["spec"]["template"]
        value: str = pod["metadata"]["annotations"]["checksum/settings"]
        return value

    base = checksum(INLINE_POLICY)
    assert checksum(INLINE_POLICY) == base
    assert checksum(merged(INLINE_POLICY, {"config": {"max_in_job_restarts": 5}})) != base
    changed = POLICY_SOURCE.replace('reason="xid"', 'reason="an xid"')
    assert checksum(merged(INLINE_POLICY, {"policy": {"inline": changed}})) != base


# --- tokens and database ----------------------------------------------------------------------


def test_tokens_are_generated_distinct_and_workers_get_only_theirs() -> None:
    docs = render(merged(POSTGRES, {"workloadNamespace": "jobs"}))
    name = f"{FULLNAME}-tokens"
    keys = ["agent-token", "operator-token", "host-monitor-actuator-token", "worker-token"]
    tokens = [secret_value(docs, name, k) for k in keys]
    assert len(set(tokens)) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9]{48}", t) for t in tokens)
    assert find(docs, "Secret", name)["metadata"]["namespace"] == NAMESPACE
    worker = find(docs, "Secret", f"{FULLNAME}-worker-token")
    assert worker["metadata"]["namespace"] == "jobs"
    assert list(worker["data"]) == ["token"]
    assert secret_value(docs, f"{FULLNAME}-worker-token", "token") == tokens[3]
    # A second render (no cluster: lookup finds nothing) generates new ones; on a cluster
    # the Secret is read back instead (see the template).
    assert secret_value(render(POSTGRES), name, "agent-token") != tokens[0]
    assert "lookup" in (CHART / "templates" / "secrets.yaml").read_text()


def test_given_tokens_and_an_existing_secret() -> None:
    docs = render(merged(POSTGRES, {"auth": TOKENS}))
    assert secret_value(docs, f"{FULLNAME}-tokens", "operator-token") == TOKENS["operatorToken"]
    assert secret_value(docs, f"{FULLNAME}-worker-token", "token") == TOKENS["workerToken"]

    docs = render(merged(POSTGRES, {"auth": {"existingSecret": "my-tokens"}}))
    assert "Secret" not in {d["kind"] for d in docs if "token" in d["metadata"]["name"]}
    for kind, name in (("Deployment", FULLNAME), ("DaemonSet", None)):
        refs = {
            v["valueFrom"]["secretKeyRef"]["name"]
            for v in container(docs, kind, name)["env"]
            if "secretKeyRef" in v.get("valueFrom", {}) and v["name"] != "SUPERVISOR_DATABASE_URL"
        }
        assert refs == {"my-tokens"}


def test_postgresql_url_from_a_secret_or_an_existing_one() -> None:
    docs = render(POSTGRES)
    assert secret_value(docs, f"{FULLNAME}-database", "url") == PG_URL
    settings_yaml = find(docs, "ConfigMap", f"{FULLNAME}-settings")["data"]["settings.yaml"]
    assert "postgresql" not in settings_yaml  # the URL (a password) is never in a ConfigMap

    docs = render({"database": {"existingSecret": "pg", "existingSecretKey": "dsn"}})
    env = {v["name"]: v for v in container(docs, "Deployment", FULLNAME)["env"]}
    assert env["SUPERVISOR_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "pg",
        "key": "dsn",
    }
    assert not [d for d in docs if d["metadata"]["name"].endswith("-database")]


def test_sqlite_on_a_volume_claim_for_one_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(
        merged(SQLITE, {"database": {"sqlite": {"size": "5Gi", "storageClassName": "ssd"}}})
    )
    pvc = find(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert pvc["spec"]["storageClassName"] == "ssd"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert find(docs, "Deployment", FULLNAME)["spec"]["replicas"] == 1
    assert "PodDisruptionBudget" not in kinds(docs)  # a budget for one pod blocks drains
    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    c = container(docs, "Deployment", FULLNAME)
    data = next(m for m in c["volumeMounts"] if m["name"] == "data")
    assert settings.database_url == f"sqlite:///{data['mountPath']}/supervisor.db"
    volumes = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["volumes"]
    claim = next(v for v in volumes if v["name"] == "data")["persistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"]
    # The non-root user can write the volume.
    pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]

    docs = render(merged(SQLITE, {"database": {"sqlite": {"existingClaim": "old-data"}}}))
    assert "PersistentVolumeClaim" not in kinds(docs)
    volumes = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "data")["persistentVolumeClaim"] == {
        "claimName": "old-data"
    }


# --- policies ---------------------------------------------------------------------------------


def _load_mounted_policy(
    docs: list[dict[str, Any]],
    configmap: dict[str, Any],
    spec: str,
    root: Path,
    deployment_name: str = FULLNAME,
) -> Policy:
    """Lay the ConfigMap out as the kubelet mounts it (under `root`), then load `spec`
    with the supervisor's own loader."""
    deployment = find(docs, "Deployment", deployment_name)["spec"]["template"]["spec"]
    volume = next(v for v in deployment["volumes"] if v["name"] == "policy")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    mount = next(m for m in deployment["containers"][0]["volumeMounts"] if m["name"] == "policy")
    assert mount["readOnly"] is True
    for item in volume["configMap"]["items"]:
        target = root / mount["mountPath"].lstrip("/") / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(configmap["data"][item["key"]])
    path, _, class_name = spec.rpartition(":")
    assert path.startswith(mount["mountPath"] + "/")
    return load_policy(f"{root}{path}:{class_name}")


def test_inline_policy_is_mounted_where_the_supervisor_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(INLINE_POLICY)
    configmap = find(docs, "ConfigMap", f"{FULLNAME}-policy")
    assert configmap["data"]["policy.py"].strip() == POLICY_SOURCE.strip()
    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    assert settings.policy == "/etc/resiliency-supervisor/policy/policy.py:CordonOnXid"
    policy = _load_mounted_policy(docs, configmap, settings.policy, tmp_path / "root")
    assert type(policy).__name__ == "CordonOnXid"
    assert isinstance(policy, Policy)


def test_policy_from_an_existing_configmap(tmp_path: Path) -> None:
    values = merged(
        POSTGRES,
        {
            "policy": {
                "existingConfigMap": "team-policy",
                "fileName": "ours.py",
                "className": "CordonOnXid",
            }
        },
    )
    docs = render(values)
    assert not [d for d in docs if d["metadata"]["name"].endswith("-policy")]
    settings = yaml.safe_load(
        find(docs, "ConfigMap", f"{FULLNAME}-settings")["data"]["settings.yaml"]
    )
    assert settings["policy"] == "/etc/resiliency-supervisor/policy/ours.py:CordonOnXid"
    existing = {"metadata": {"name": "team-policy"}, "data": {"ours.py": POLICY_SOURCE}}
    policy = _load_mounted_policy(docs, existing, settings["policy"], tmp_path)
    assert type(policy).__name__ == "CordonOnXid"


def test_default_policy_is_the_packaged_one() -> None:
    docs = render(POSTGRES)
    settings = yaml.safe_load(
        find(docs, "ConfigMap", f"{FULLNAME}-settings")["data"]["settings.yaml"]
    )
    assert settings["policy"] == "policies.default:DefaultPolicy"
    assert type(load_policy(settings["policy"])).__name__ == "DefaultPolicy"
    assert not [
        m for m in container(docs, "Deployment", FULLNAME)["volumeMounts"] if m["name"] == "policy"
    ]


# --- the host monitor DaemonSet ---------------------------------------------------------------


def host_monitor_settings(docs: list[dict[str, Any]]) -> HostMonitorSettings:
    env = resolve_env(docs, container(docs, "DaemonSet")["env"])
    ours = {k: v for k, v in env.items() if k.startswith("HOST_MONITOR_")}
    for name in ours:
        assert name.removeprefix("HOST_MONITOR_").lower() in HostMonitorSettings.model_fields, name
    fields = {k.removeprefix("HOST_MONITOR_").lower(): v for k, v in ours.items()}
    return HostMonitorSettings(**fields)


def test_host_monitor_runs_on_gpu_nodes_and_reaches_the_supervisor() -> None:
    values = merged(
        POSTGRES,
        {"config": {"heartbeat_polling_period_s": 2.0, "gpu_report_cooldown_s": 30.0}},
    )
    docs = render(values)
    ds = find(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    tolerations = pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    # It keeps running on the nodes the supervisor taints.
    assert {
        "key": "resiliency.supervisor.io/unhealthy",
        "operator": "Exists",
        "effect": "NoExecute",
    } in tolerations
    settings = host_monitor_settings(docs)
    assert settings.node == "gpu-node-1"  # spec.nodeName
    service = find(docs, "Service", FULLNAME)
    assert (
        settings.supervisor_url
        == f"http://{FULLNAME}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}"
    )
    assert settings.host == "10.4.0.7"  # the pod IP: the address its heartbeat carries
    assert settings.host_daemon_port == 9400
    assert settings.heartbeat_polling_period_s == 2.0
    assert settings.gpu_report_cooldown_s == 30.0
    # The same tokens on both sides.
    sup = resolve_env(docs, container(docs, "Deployment", FULLNAME)["env"])
    assert settings.agent_token is not None and settings.actuator_token is not None
    assert settings.agent_token.get_secret_value() == sup["SUPERVISOR_AGENT_TOKEN"]
    assert (
        settings.actuator_token.get_secret_value() == sup["SUPERVISOR_HOST_MONITOR_ACTUATOR_TOKEN"]
    )
    # The supervisor knows the port of the host monitors.
    sup_settings = yaml.safe_load(
        find(docs, "ConfigMap", f"{FULLNAME}-settings")["data"]["settings.yaml"]
    )
    assert sup_settings["host_monitor_port"] == settings.host_daemon_port
    # Workers find the monitor of their own node through a node-local Service.
    hm_service = find(docs, "Service", f"{FULLNAME}-host-monitor")
    assert hm_service["spec"]["internalTrafficPolicy"] == "Local"
    assert (
        hm_service["spec"]["selector"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert hm_service["spec"]["ports"][0]["port"] == 9400
    probe = container(docs, "DaemonSet")["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "http"}


def test_kubernetes_identity_gives_each_host_monitor_its_own_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hostMonitor.identity.mode kubernetes: each host monitor sends its pod's projected
    service account token (bound to the audience, short-lived), not the shared agent token;
    the supervisor reviews it as that service account's (a ClusterRole with only
    TokenReview create); acceptSharedToken keeps the shared token for an upgrade."""
    shared = render(POSTGRES)
    assert [d["metadata"]["name"] for d in shared if d["kind"] == "ClusterRole"] == [
        f"{NAMESPACE}-{FULLNAME}-nodes"
    ]
    assert host_monitor_settings(shared).agent_token is not None

    docs = render(KUBE_IDENTITY)
    hm = host_monitor_settings(docs)
    assert hm.agent_token is None
    token_path = Path("/var/run/secrets/resiliency-supervisor/token")
    assert hm.service_account_token_file == token_path
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["identity"]["projected"]["sources"] == [
        {
            "serviceAccountToken": {
                "audience": "resiliency-supervisor",
                "expirationSeconds": 600,
                "path": "token",
            }
        }
    ]
    mounts = {m["name"]: m for m in container(docs, "DaemonSet")["volumeMounts"]}
    assert mounts["identity"] == {
        "name": "identity",
        "mountPath": str(token_path.parent),
        "readOnly": True,
    }
    assert pod["automountServiceAccountToken"] is False  # no token for the API itself

    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    assert settings.agent_auth == ["kubernetes"]
    assert settings.agent_kube_audience == "resiliency-supervisor"
    sa = find(docs, "ServiceAccount", pod["serviceAccountName"])
    assert settings.agent_kube_service_account == (
        f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    )
    role = find(docs, "ClusterRole", f"{NAMESPACE}-{FULLNAME}-tokenreviews")
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    binding = find(docs, "ClusterRoleBinding", role["metadata"]["name"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
    ]

    upgrade = render(
        merged(KUBE_IDENTITY, {"hostMonitor": {"identity": {"acceptSharedToken": True}}})
    )
    assert supervisor_settings(upgrade, tmp_path, monkeypatch).agent_auth == [
        "shared",
        "kubernetes",
    ]
    with pytest.raises(helm.HelmValuesError, match="tokenExpirationSeconds"):
        render(merged(KUBE_IDENTITY, {"hostMonitor": {"identity": {"tokenExpirationSeconds": 60}}}))


@pytest.mark.parametrize("source", ["kmsg", "file", "off"])
def test_host_monitor_has_only_the_privileges_its_kernel_log_needs(source: str) -> None:
    host_monitor = {"kernelLog": {"source": source}, "peerTier": {"enabled": False}}
    docs = render(merged(POSTGRES, {"hostMonitor": host_monitor}))
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    # Always: the host's PID namespace (poll and signal workers of other pods); never the
    # host network or IPC; no Kubernetes API token.
    assert pod["hostPID"] is True
    assert "hostNetwork" not in pod and "hostIPC" not in pod
    assert pod["automountServiceAccountToken"] is False
    c = container(docs, "DaemonSet")
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    kernel_log = host_monitor_settings(docs).kernel_log
    if source == "kmsg":
        assert sc["privileged"] is True
        assert host_paths == {"kmsg": {"path": "/dev/kmsg", "type": "CharDevice"}}
        assert mounts["kmsg"] == {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True}
        assert kernel_log == "/dev/kmsg"
    else:
        assert "privileged" not in sc
        assert sc["allowPrivilegeEscalation"] is False
        added = ["KILL", "DAC_READ_SEARCH"] if source == "file" else ["KILL"]
        assert sc["capabilities"] == {"drop": ["ALL"], "add": added}
    if source == "file":
        assert host_paths == {"kernel-log": {"path": "/var/log", "type": "Directory"}}
        assert mounts["kernel-log"]["readOnly"] is True
        assert kernel_log == "/var/log/kern.log"
    if source == "off":
        assert host_paths == {}
        assert kernel_log == "none"


def test_the_peer_tier_adds_its_directories_its_token_and_two_capabilities() -> None:
    docs = render(merged(POSTGRES, {"hostMonitor": {"kernelLog": {"source": "off"}}}))
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    c = container(docs, "DaemonSet")
    # Write a fetched copy into a worker's RAM directory, as that worker's user.
    assert c["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["KILL", "DAC_OVERRIDE", "CHOWN"],
    }
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        "ram-checkpoints": {"path": "/dev/shm/resiliency-checkpoints", "type": "DirectoryOrCreate"},
        # Partner copies on the node's disk by default (host_monitor/README.md).
        "peer-store": {
            "path": "/var/lib/resiliency-supervisor/peer",
            "type": "DirectoryOrCreate",
        },
    }
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["ram-checkpoints"] == "/dev/shm/resiliency-checkpoints"
    env = {e["name"]: e for e in c["env"]}
    token = env["HOST_MONITOR_PEER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["key"] == "peer-token" and token["optional"] is True
    settings = host_monitor_settings(docs)
    assert str(settings.checkpoint_root) == "/dev/shm/resiliency-checkpoints"
    # The token is generated with the others, and differs from them.
    secret = next(
        d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-tokens")
    )
    assert "peer-token" in secret["data"]
    assert len(set(secret["data"].values())) == len(secret["data"])


def test_the_host_monitor_is_sized_from_its_peer_store() -> None:
    """The rule of templates/_host-monitor-resources.tpl: the base resources, plus 32Mi of
    transfer buffers, the CPU to move one copy (a third of the store) within copyWithinSeconds,
    and with the store on tmpfs the store itself, in the memory request and limit."""
    base = {"hostMonitor": {"kernelLog": {"source": "off"}}}
    peer = {"storeSizeGiB": 48, "copyWithinSeconds": 60, "cpuMillisecondsPerGiB": 1000}
    for medium, store_mi, path in (
        ("disk", 0, "/var/lib/resiliency-supervisor/peer"),
        ("memory", 48 * 1024, "/dev/shm/resiliency-peer"),
    ):
        values = {"hostMonitor": {"peerTier": {**peer, "storeMedium": medium}}}
        docs = render(merged(POSTGRES, base, values))
        c = container(docs, "DaemonSet")
        copy_cpu = 48 * 1000 // (3 * 60) + 1
        assert c["resources"] == {
            "requests": {"cpu": "50m", "memory": f"{96 + store_mi}Mi"},
            "limits": {"cpu": f"{500 + copy_cpu}m", "memory": f"{256 + 32 + store_mi}Mi"},
        }, medium
        settings = host_monitor_settings(docs)
        assert settings.peer_store_max_bytes == 48 * 2**30
        assert settings.peer_channel_port == 9401
        assert str(settings.peer_store_dir) == f"{path}/$(HOST_MONITOR_NODE)"
        pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
        store = next(v for v in pod["volumes"] if v["name"] == "peer-store")
        assert store["hostPath"]["path"] == path
        assert {"name": "peer-data", "containerPort": 9401, "protocol": "TCP"} in c["ports"]
    # Resources given in Gi and whole cores are added to as well.
    values = {"hostMonitor": {"resources": {"limits": {"cpu": "2", "memory": "1Gi"}}}}
    c = container(render(merged(POSTGRES, base, values)), "DaemonSet")
    assert c["resources"]["limits"] == {
        "cpu": f"{2000 + 64 * 1000 // 360 + 1}m",
        "memory": f"{1024 + 32}Mi",
    }
    # The peer tier off: the resources as given.
    values = {"hostMonitor": {"peerTier": {"enabled": False}}}
    c = container(render(merged(POSTGRES, base, values)), "DaemonSet")
    assert c["resources"] == DEFAULT_VALUES["hostMonitor"]["resources"]
    assert [p["name"] for p in c["ports"]] == ["http"]
    # A quantity the rule cannot add to is refused, naming it.
    values = {"hostMonitor": {"resources": {"limits": {"memory": "1G"}}}}
    with pytest.raises(helm.HelmError, match="memory"):
        render(merged(POSTGRES, base, values))


def test_every_host_monitor_privilege_is_justified_in_a_comment() -> None:
    lines = (CHART / "templates" / "host-monitor.yaml").read_text().splitlines()
    for marker in ("hostPID: true", "privileged: true", "add: ", "DAC_OVERRIDE", "runAsUser: 0"):
        index = next(i for i, line in enumerate(lines) if marker in line)
        before = [line.strip() for line in lines[max(0, index - 6) : index]]
        assert any(line.startswith("#") for line in before), marker


# --- TLS --------------------------------------------------------------------------------------

TLS_DIR = "/etc/resiliency-supervisor/tls"
HM_SERVICE_NAME = f"{FULLNAME}-host-monitor.{NAMESPACE}.svc"


def certificates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The cert-manager Certificates by the Secret they fill, each checked for the fields
    cert-manager requires."""
    out = {}
    for doc in docs:
        if doc["kind"] != "Certificate":
            continue
        assert doc["apiVersion"] == "cert-manager.io/v1"
        spec = doc["spec"]
        assert spec["secretName"] and spec["issuerRef"]["name"] and spec["dnsNames"]
        assert spec["usages"] == ["digital signature", "key encipherment", "server auth"]
        out[spec["secretName"]] = spec
    return out


def tls_volume(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The TLS Secret volume of the Deployment or DaemonSet, and that it is mounted
    read-only where the settings point."""
    pod = find(docs, kind, name)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    (mount,) = [m for m in container(docs, kind, name)["volumeMounts"] if m["name"] == "tls"]
    assert mount == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
    secret: dict[str, Any] = volume["secret"]
    return secret


def test_tls_values_change_nothing_while_tls_is_off() -> None:
    tokens = {**TOKENS, "peerToken": "peer-token-0123456789"}  # nothing generated: comparable
    plain = render_files(merged(POSTGRES, {"auth": tokens}))
    ignored = {
        "enabled": False,
        "existingSecret": "rs-tls",
        "hostMonitorExistingSecret": "rs-hm-tls",
        "certManager": {"issuerRef": {"name": "team-ca"}, "duration": "720h"},
    }
    assert render_files(merged(POSTGRES, {"auth": tokens, "tls": ignored})) == plain
    text = "".join(plain.values())
    assert "https" not in text.replace("https://supervisor.example", "")
    assert "HTTPS" not in text and "cert-manager.io" not in text and "TLS_" not in text


def test_tls_with_cert_manager_serves_https_verified_by_the_issuers_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(merged(CERT_MANAGER, {"serviceMonitor": {"enabled": True}}))
    certs = certificates(docs)
    sup_secret, hm_secret = f"{FULLNAME}-tls", f"{FULLNAME}-host-monitor-tls"
    assert set(certs) == {sup_secret, hm_secret}  # the host monitors' key is not the supervisor's
    for spec in certs.values():
        assert spec["issuerRef"] == {
            "name": "team-ca",
            "kind": "Issuer",
            "group": "cert-manager.io",
        }
        assert (spec["duration"], spec["renewBefore"]) == ("2160h", "360h")
    assert certs[sup_secret]["dnsNames"] == [
        FULLNAME,
        f"{FULLNAME}.{NAMESPACE}",
        f"{FULLNAME}.{NAMESPACE}.svc",
    ]
    assert HM_SERVICE_NAME in certs[hm_secret]["dnsNames"]

    # The supervisor: its certificate, key and CA from its Secret, probed over HTTPS.
    assert tls_volume(docs, "Deployment", FULLNAME) == {
        "secretName": sup_secret,
        "defaultMode": 0o440,
    }
    c = container(docs, "Deployment", FULLNAME)
    assert c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    assert (settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file) == (
        f"{TLS_DIR}/tls.crt",
        f"{TLS_DIR}/tls.key",
        f"{TLS_DIR}/ca.crt",
    )
    # Host monitors are reached at their pod IP: checked against their Service's name,
    # which their certificate holds.
    assert settings.tls_host_monitor_server_name == HM_SERVICE_NAME
    assert settings.host_monitor_scheme == "https"

    # The host monitors: their own Secret, HTTPS probes, an https:// supervisor whose
    # certificate names the host they dial.
    assert tls_volume(docs, "DaemonSet") == {"secretName": hm_secret, "defaultMode": 0o400}
    hm_c = container(docs, "DaemonSet")
    assert hm_c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert hm_c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    hm = host_monitor_settings(docs)
    assert hm.scheme == "https"
    assert (hm.tls_cert_file, hm.tls_key_file, hm.tls_ca_file) == (
        Path(f"{TLS_DIR}/tls.crt"),
        Path(f"{TLS_DIR}/tls.key"),
        Path(f"{TLS_DIR}/ca.crt"),
    )
    assert hm.tls_server_name == HM_SERVICE_NAME  # partners are reached at pod IPs too
    assert hm.supervisor_url is not None
    url = urllib.parse.urlsplit(hm.supervisor_url)
    assert url.scheme == "https" and url.hostname in certs[sup_secret]["dnsNames"]

    # Prometheus scrapes the leader's pod IP: with the CA, against the Service's name.
    (endpoint,) = find(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": sup_secret, "key": "ca.crt"}},
        "serverName": f"{FULLNAME}.{NAMESPACE}.svc",
    }
    notes = render_files(CERT_MANAGER)["resiliency-supervisor/templates/NOTES.txt"]
    assert f"HOST_MONITOR_URL=https://{HM_SERVICE_NAME}:9400" in notes
    assert f"--tls-server-name {FULLNAME}.{NAMESPACE}.svc" in notes


def test_tls_from_existing_secrets() -> None:
    one = render(EXISTING_TLS)
    assert certificates(one) == {}
    assert tls_volume(one, "Deployment", FULLNAME)["secretName"] == "rs-tls"
    assert tls_volume(one, "DaemonSet")["secretName"] == "rs-tls"

    two = render(merged(EXISTING_TLS, {"tls": {"hostMonitorExistingSecret": "rs-hm-tls"}}))
    assert certificates(two) == {}
    assert tls_volume(two, "Deployment", FULLNAME)["secretName"] == "rs-tls"
    assert tls_volume(two, "DaemonSet")["secretName"] == "rs-hm-tls"

    # The host monitors' Secret given, the supervisor's from cert-manager.
    mixed = render(merged(CERT_MANAGER, {"tls": {"hostMonitorExistingSecret": "rs-hm-tls"}}))
    assert set(certificates(mixed)) == {f"{FULLNAME}-tls"}
    assert tls_volume(mixed, "DaemonSet")["secretName"] == "rs-hm-tls"

    # No host monitors: one Certificate.
    alone = render(merged(CERT_MANAGER, {"hostMonitor": {"enabled": False}}))
    assert set(certificates(alone)) == {f"{FULLNAME}-tls"}


# --- the shadow supervisor --------------------------------------------------------------------


def pod_spec(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, kind, name)["spec"]["template"]["spec"]
    return spec


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_shadow_is_off_by_default_and_its_values_change_nothing_while_off() -> None:
    tokens = {**TOKENS, "peerToken": "peer-token-0123456789"}  # nothing generated: comparable
    plain = render_files(merged(POSTGRES, {"auth": tokens}))
    ignored = {
        "enabled": False,
        "policy": SHADOW_POLICY,
        "settings": {"heartbeat_timeout_s": 30.0},
        "database": {"url": "postgresql://shadow@db/x", "sizeLimit": "2Gi"},
        "nodeSelector": {"pool": "infra"},
    }
    assert render_files(merged(POSTGRES, {"auth": tokens, "shadow": ignored})) == plain
    docs = render(merged(POSTGRES, {"auth": tokens}))
    assert not [d for d in docs if "shadow" in d["metadata"]["name"]]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"] == [FULLNAME, RELAY]
    env = {v["name"] for v in container(docs, "DaemonSet")["env"]}
    assert "HOST_MONITOR_SHADOW_SUPERVISOR_URLS" not in env
    assert host_monitor_settings(docs).shadow_supervisor_urls == []


def test_shadow_runs_its_policy_in_dry_run_with_the_acting_settings_and_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = merged(
        SHADOW_ON,
        {
            "config": {
                "num_dp_replicas": 8,
                "max_num_dp_replicas": 8,
                "log_level": "debug",
                "enable_workload_scaling": True,
            },
            "notifications": {
                "routes": [{"name": "hook", "sink": {"type": "webhook", "url": "https://h/x"}}]
            },
            "shadow": {
                "policy": SHADOW_POLICY,
                # Over config: a value of its own, and a false over a true.
                "settings": {"heartbeat_timeout_s": 30.0, "enable_workload_scaling": False},
            },
        },
    )
    docs = render(values)
    deployment = find(docs, "Deployment", SHADOW)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}

    acting = supervisor_settings(docs, tmp_path / "acting", monkeypatch, FULLNAME)
    shadow = supervisor_settings(docs, tmp_path / "shadow", monkeypatch, SHADOW)
    assert (acting.dry_run, acting.leader_election) == (False, True)
    assert (shadow.dry_run, shadow.leader_election) == (True, False)
    assert acting.policy == "policies.default:DefaultPolicy"
    assert shadow.policy == SHADOW_POLICY
    assert type(load_policy(shadow.policy)).__name__ == "PeriodicCheckpointsOnly"
    # Its own settings over the acting supervisor's, which it otherwise shares.
    assert (acting.heartbeat_timeout_s, shadow.heartbeat_timeout_s) == (15.0, 30.0)
    assert (acting.enable_workload_scaling, shadow.enable_workload_scaling) == (True, False)
    assert shadow.num_dp_replicas == acting.num_dp_replicas == 8
    assert shadow.log_level == acting.log_level == "debug"
    for name in ("backend", "kube_namespace", "host", "port", "host_monitor_port", "agent_auth"):
        assert getattr(shadow, name) == getattr(acting, name), name
    # Its events are the acting supervisor's again: nobody is notified twice.
    assert len(acting.notification_routes) == 1
    assert shadow.notification_routes == []
    # It accepts what host monitors present to the acting supervisor, and the operators';
    # it cannot call a host monitor, and elects no leader.
    assert shadow.agent_token == acting.agent_token is not None
    assert shadow.operator_token == acting.operator_token is not None
    assert acting.host_monitor_actuator_token is not None
    assert shadow.host_monitor_actuator_token is None
    env = {v["name"]: v for v in container(docs, "Deployment", SHADOW)["env"]}
    assert set(env) == {
        "SUPERVISOR_AGENT_TOKEN",
        "SUPERVISOR_OPERATOR_TOKEN",
        "SUPERVISOR_LOG_FORMAT",
    }
    # It logs as the acting supervisor does (the chart's logFormat, json by default).
    assert env["SUPERVISOR_LOG_FORMAT"]["value"] == "json"
    main_env = {v["name"]: v for v in container(docs, "Deployment", FULLNAME)["env"]}
    assert main_env["SUPERVISOR_LOG_FORMAT"]["value"] == "json"
    # Probed, bounded and locked down as the acting supervisor.
    c, main = container(docs, "Deployment", SHADOW), container(docs, "Deployment", FULLNAME)
    for key in ("securityContext", "livenessProbe", "readinessProbe", "ports", "command"):
        assert c[key] == main[key], key
    assert c["resources"] == DEFAULT_VALUES["shadow"]["resources"]
    pod = pod_spec(docs, "Deployment", SHADOW)
    assert pod["securityContext"] == pod_spec(docs, "Deployment", FULLNAME)["securityContext"]
    # A change of its settings restarts it.
    checksum = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/settings"]
    other = merged(values, {"shadow": {"settings": {"heartbeat_timeout_s": 45.0}}})
    other_deployment = find(render(other), "Deployment", SHADOW)
    assert other_deployment["spec"]["template"]["metadata"]["annotations"]["checksum/settings"] != (
        checksum
    )


def test_shadow_without_a_policy_of_its_own_runs_the_acting_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(merged(INLINE_POLICY, SHADOW_ON))
    acting = supervisor_settings(docs, tmp_path / "acting", monkeypatch, FULLNAME)
    shadow = supervisor_settings(docs, tmp_path / "shadow", monkeypatch, SHADOW)
    assert shadow.policy == acting.policy
    configmap = find(docs, "ConfigMap", f"{FULLNAME}-policy")
    policy = _load_mounted_policy(docs, configmap, shadow.policy, tmp_path / "root", SHADOW)
    assert type(policy).__name__ == "CordonOnXid"
    # A policy of its own: nothing mounted.
    docs = render(merged(INLINE_POLICY, SHADOW_ON, {"shadow": {"policy": SHADOW_POLICY}}))
    assert not [v for v in pod_spec(docs, "Deployment", SHADOW)["volumes"] if v["name"] == "policy"]


def test_shadow_and_acting_supervisor_share_no_pod_account_or_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(SHADOW_ON)
    acting_pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]
    shadow_pod = find(docs, "Deployment", SHADOW)["spec"]["template"]
    acting_labels, shadow_labels = (
        acting_pod["metadata"]["labels"],
        shadow_pod["metadata"]["labels"],
    )
    # Each Service, the budget and each Deployment select their own pods only.
    acting_service, shadow_service = find(docs, "Service", FULLNAME), find(docs, "Service", SHADOW)
    assert selects(acting_service["spec"]["selector"], acting_labels)
    assert not selects(acting_service["spec"]["selector"], shadow_labels)
    assert selects(shadow_service["spec"]["selector"], shadow_labels)
    assert not selects(shadow_service["spec"]["selector"], acting_labels)
    assert not selects(
        find(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], shadow_labels
    )
    for name, labels in ((FULLNAME, shadow_labels), (SHADOW, acting_labels)):
        assert not selects(
            find(docs, "Deployment", name)["spec"]["selector"]["matchLabels"], labels
        )
    assert shadow_service["spec"]["type"] == "ClusterIP"
    # Its own ServiceAccount.
    assert acting_pod["spec"]["serviceAccountName"] == FULLNAME
    assert shadow_pod["spec"]["serviceAccountName"] == SHADOW
    assert find(docs, "ServiceAccount", SHADOW)["metadata"]["namespace"] == NAMESPACE

    # Its own database: SQLite on an emptyDir of its pod, by default.
    shadow = supervisor_settings(docs, tmp_path, monkeypatch, SHADOW)
    data = next(
        m for m in container(docs, "Deployment", SHADOW)["volumeMounts"] if m["name"] == "data"
    )
    assert shadow.database_url == f"sqlite:///{data['mountPath']}/supervisor.db"
    volume = next(v for v in shadow_pod["spec"]["volumes"] if v["name"] == "data")
    assert volume == {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}}
    assert "PersistentVolumeClaim" not in kinds(docs)
    # Or a PostgreSQL database of its own, from a Secret.
    url = "postgresql+psycopg://shadow:secret@db.example:5432/shadow"
    docs = render(merged(SHADOW_ON, {"shadow": {"database": {"url": url}}}))
    env = {v["name"]: v for v in container(docs, "Deployment", SHADOW)["env"]}
    ref = env["SUPERVISOR_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{SHADOW}-database", "key": "url"}
    assert secret_value(docs, f"{SHADOW}-database", "url") == url
    assert secret_value(docs, f"{FULLNAME}-database", "url") == PG_URL
    assert not [v for v in pod_spec(docs, "Deployment", SHADOW)["volumes"] if v["name"] == "data"]
    settings_yaml = find(docs, "ConfigMap", f"{SHADOW}-settings")["data"]["settings.yaml"]
    assert "postgresql" not in settings_yaml and "sqlite" not in settings_yaml
    # The acting supervisor's Secret under another key is another database.
    docs = render(
        merged(
            SHADOW_ON,
            {
                "database": {"url": "", "existingSecret": "pg", "existingSecretKey": "dsn"},
                "shadow": {"database": {"existingSecret": "pg", "existingSecretKey": "shadow"}},
            },
        )
    )
    env = {v["name"]: v for v in container(docs, "Deployment", SHADOW)["env"]}
    assert env["SUPERVISOR_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "pg",
        "key": "shadow",
    }


def granted_to(docs: list[dict[str, Any]], account: str) -> set[tuple[str, str, str, str]]:
    """(namespace or "", group, resource, verb) for every rule bound to the ServiceAccount."""
    out = set()
    for binding in docs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subject = {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
        if subject not in binding["subjects"]:
            continue
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace", "")
        role = next(
            d
            for d in docs
            if d["kind"] == ref["kind"]
            and d["metadata"]["name"] == ref["name"]
            and d["metadata"].get("namespace", "") == namespace
        )
        for rule in role["rules"]:
            assert "resourceNames" not in rule or ref["kind"] == "Role"
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        out.add((namespace, group, resource, verb))
    return out


@pytest.mark.parametrize(
    ("values", "workload_ns", "kube_identity"),
    [
        (SHADOW_ON, NAMESPACE, False),
        (merged(KUBE_IDENTITY, SHADOW_ON), NAMESPACE, True),
        (merged(SHADOW_ON, {"workloadNamespace": "jobs"}), "jobs", False),
    ],
)
def test_shadow_may_only_read(
    values: dict[str, Any], workload_ns: str, kube_identity: bool
) -> None:
    """The shadow's ServiceAccount may list and watch what the informers of
    supervisor/kube/discovery.py list and watch (the only calls a dry-run supervisor makes),
    and, with the kubernetes identity, review tokens: no other verb, nowhere."""
    informers: set[tuple[str, str, str]] = set()
    for call in API_CALL.findall((ROOT / "supervisor" / "kube" / "discovery.py").read_text()):
        informers |= set(CLIENT_CALLS[call])
    assert {verb for _, _, verb in informers} == {"list", "watch"}, "the scan is broken"
    docs = render(values)
    granted = granted_to(docs, SHADOW)
    token_review = ("", "authentication.k8s.io", "tokenreviews", "create")
    reads = {g for g in granted if g != token_review}
    assert {verb for *_, verb in reads} <= {"get", "list", "watch"}
    assert (token_review in granted) == kube_identity
    expected = {
        ("" if resource == "nodes" else workload_ns, group, resource, verb)
        for group, resource, verb in informers
    }
    assert reads == expected
    # Nothing of the acting supervisor's is bound to it, nor its to the acting supervisor.
    acting = granted_to(docs, FULLNAME)
    assert ("", "", "nodes", "patch") in acting and (workload_ns, "", "events", "create") in acting
    assert not any(
        SHADOW in [s["name"] for s in b["subjects"]]
        and b["roleRef"]["name"] in (FULLNAME, f"{NAMESPACE}-{FULLNAME}-nodes")
        for b in docs
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
    )
    assert all(
        s["name"] != SHADOW
        for b in docs
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and "shadow" not in b["metadata"]["name"]
        for s in b["subjects"]
    )
    # Without rbac.create, none of it (and the cluster admin grants what is above).
    docs = render(merged(values, {"rbac": {"create": False}}))
    assert granted_to(docs, SHADOW) == set()


def test_host_monitors_copy_their_heartbeats_to_the_shadow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(merged(KUBE_IDENTITY, SHADOW_ON))
    hm = host_monitor_settings(docs)
    service = find(docs, "Service", SHADOW)
    port = service["spec"]["ports"][0]["port"]
    assert hm.shadow_supervisor_urls == [f"http://{SHADOW}.{NAMESPACE}.svc:{port}"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in container(
        docs, "Deployment", SHADOW
    )["ports"]
    # The shadow accepts what they present to the acting supervisor: here, their own
    # service account token, reviewed for the same audience and account.
    acting = supervisor_settings(docs, tmp_path / "acting", monkeypatch, FULLNAME)
    shadow = supervisor_settings(docs, tmp_path / "shadow", monkeypatch, SHADOW)
    assert shadow.agent_auth == acting.agent_auth == ["kubernetes"]
    assert shadow.agent_kube_audience == acting.agent_kube_audience
    assert shadow.agent_kube_service_account == acting.agent_kube_service_account


@pytest.mark.parametrize("source", ["cert-manager", "existing-secret"])
def test_shadow_serves_https_under_a_name_the_supervisor_certificate_holds(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls = CERT_MANAGER if source == "cert-manager" else EXISTING_TLS
    docs = render(merged(tls, SHADOW_ON))
    secret = f"{FULLNAME}-tls" if source == "cert-manager" else "rs-tls"
    pod = pod_spec(docs, "Deployment", SHADOW)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"] == {"secretName": secret, "defaultMode": 0o440}
    c = container(docs, "Deployment", SHADOW)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    assert mount == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
    assert c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    shadow = supervisor_settings(docs, tmp_path, monkeypatch, SHADOW)
    assert (shadow.tls_cert_file, shadow.tls_key_file) == (
        f"{TLS_DIR}/tls.crt",
        f"{TLS_DIR}/tls.key",
    )
    (url,) = host_monitor_settings(docs).shadow_supervisor_urls
    parts = urllib.parse.urlsplit(url)
    assert parts.scheme == "https" and parts.hostname == f"{SHADOW}.{NAMESPACE}.svc"
    if source == "cert-manager":
        names = certificates(docs)[secret]["dnsNames"]
        assert parts.hostname in names and SHADOW in names
        assert f"{FULLNAME}.{NAMESPACE}.svc" in names  # still the acting supervisor's
        # Without the shadow, the certificate names the acting supervisor only.
        alone = certificates(render(tls))[secret]["dnsNames"]
        assert not [n for n in alone if "shadow" in n]
    else:
        assert certificates(docs) == {}


def test_shadow_names_never_are_the_acting_ones() -> None:
    """Names are cut at 63 characters: with the longest release name Helm allows, the
    shadow's are still its own (were they the acting supervisor's, one would replace the
    other, and the shadow might get the acting supervisor's rights)."""
    release = "r" * 53
    with helm.Chart.load(CHART) as chart:
        files = chart.render(merged(KUBE_IDENTITY, SHADOW_ON), name=release, namespace=NAMESPACE)
    docs = [d for p, t in files.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    names = collections.Counter(
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs
    )
    shadow = [
        d
        for d in docs
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "shadow-supervisor"
    ]
    assert len(shadow) == 9  # ServiceAccount, Service, Deployment, ConfigMap, RBAC
    for d in shadow:
        name = d["metadata"]["name"]
        assert names[(d["kind"], d["metadata"].get("namespace"), name)] == 1, name
        assert len(name) <= (253 if d["kind"] == "ConfigMap" else 63), name  # a DNS label
        assert re.search(r"-shadow(-settings|-nodes|-tokenreviews)?$", name)


# --- ServiceMonitor, NOTES --------------------------------------------------------------------


def test_service_monitor() -> None:
    assert "ServiceMonitor" not in kinds(render(POSTGRES))
    docs = render(
        merged(
            POSTGRES,
            {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}},
        )
    )
    sm = find(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    service = find(docs, "Service", FULLNAME)
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert any(p["name"] == "http" for p in service["spec"]["ports"])
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_notes_tell_how_to_open_the_dashboard_and_inject_a_fault() -> None:
    notes = render_files(POSTGRES)["resiliency-supervisor/templates/NOTES.txt"]
    assert f"port-forward svc/{FULLNAME} 8080:8080" in notes
    assert "http://127.0.0.1:8080/" in notes
    assert f"get secret {FULLNAME}-tokens" in notes
    assert "--set config.enable_fault_injection=true" in notes

    notes = render_files(merged(POSTGRES, {"config": {"enable_fault_injection": True}}))[
        "resiliency-supervisor/templates/NOTES.txt"
    ]
    curl = next(line for line in notes.splitlines() if "/api/v1/faults" in line)
    assert "-X POST" in curl and "Authorization: Bearer $TOKEN" in curl
    # The body it shows is one the API accepts.
    body = next(line for line in notes.splitlines() if "-d '" in line)
    FaultIn.model_validate_json(shlex.split(body.strip())[-1].replace("<node>", "gpu-node-1"))
    assert "shadow" not in notes


def test_notes_tell_how_to_reach_the_shadow() -> None:
    values = merged(SHADOW_ON, {"shadow": {"policy": SHADOW_POLICY}})
    notes = render_files(values)["resiliency-supervisor/templates/NOTES.txt"]
    assert f"port-forward svc/{SHADOW} 8081:8080" in notes
    assert "http://127.0.0.1:8081/" in notes
    assert SHADOW_POLICY in notes and "would have" in notes
    # Its Service is the one the notes name, on the port they forward.
    service = find(render(values), "Service", SHADOW)
    assert service["spec"]["ports"][0]["port"] == 8080

    notes = render_files(merged(CERT_MANAGER, SHADOW_ON))[
        "resiliency-supervisor/templates/NOTES.txt"
    ]
    assert f"--tls-server-name {SHADOW}.{NAMESPACE}.svc" in notes
    assert "https://127.0.0.1:8081/" in notes


# --- every value documented and used ----------------------------------------------------------


SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULT_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def leaves(
    tree: dict[str, Any], schema: dict[str, Any] = SCHEMA, prefix: str = ""
) -> Iterator[tuple[str, Any]]:
    """Each value of the chart: objects with declared properties are walked into; free-form
    maps (nodeSelector, resources, ...) are values in themselves."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        sub = schema["properties"][key]
        if isinstance(value, dict) and "properties" in sub:
            yield from leaves(value, sub, path + ".")
        else:
            yield path, value


# The alerts of the PrometheusRule, by their key in values.
ALERTS = (
    "jobStalled",
    "checkpointStale",
    "checkpointFailing",
    "goodputLow",
    "restartBudgetSpent",
    "noSpare",
    "noLeader",
    "heartbeatsRejected",
    "hostMonitorHeartbeatsFailing",
)
# A different, valid value for leaves whose type alone does not say what is valid.
MUTATIONS: dict[str, Any] = {
    "prometheusRule.checkpointStale.tier": "ram",
    "prometheusRule.checkpointFailing.window": "30m",
    "image.repository": "registry.example/rs",
    "image.tag": "9.9.9",
    "image.pullPolicy": "Always",
    "imagePullSecrets": [{"name": "regcred"}],
    "workloadNamespace": "jobs",
    "logFormat": "text",
    "config.kube_jobset_selector": "team=llm",
    "config.kube_gpu_node_selector": "gpu=true",
    "config.kube_taint_key": "example.com/broken",
    "config.kube_node_health_label": "example.com/health",
    "config.leader_election_lease_name": "other-lease",
    "config.log_level": "debug",
    "config.hang_timeout_s": 120.0,
    "config.goodput_retention_days": 7.0,
    "config.public_url": "https://supervisor.example",
    "notifications.routes": [
        {"name": "hook", "sink": {"type": "webhook", "url": "https://hooks.example/x"}}
    ],
    "notifications.existingSecret": "rs-notifications",
    "policy.module": "policies.examples.hot_swap_on_xid:HotSwapOnXid",
    "policy.inline": POLICY_SOURCE + "\n# changed\n",
    "policy.existingConfigMap": "team-policy",
    "policy.fileName": "ours.py",
    "policy.className": "Other",
    "database.type": "sqlite",
    "database.url": "postgresql://other@db/x",
    "database.existingSecret": "pg",
    "database.existingSecretKey": "dsn",
    "database.sqlite.size": "7Gi",
    "database.sqlite.storageClassName": "ssd",
    "database.sqlite.existingClaim": "old-data",
    "auth.existingSecret": "my-tokens",
    "auth.workerSecretName": "trainer-token",
    "supervisor.tolerations": [{"key": "infra", "operator": "Exists"}],
    "supervisor.affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "infra", "operator": "Exists"}]}
                ]
            }
        }
    },
    "supervisor.priorityClassName": "critical",
    "supervisor.service.type": "NodePort",
    "hostMonitor.priorityClassName": "system-node-critical",
    "hostMonitor.tolerations": [],
    "hostMonitor.kernelLog.source": "off",
    "hostMonitor.kernelLog.path": "/var/log/other/kern.log",
    "hostMonitor.peerTier.checkpointRoot": "/dev/shm/other-checkpoints",
    "hostMonitor.peerTier.storeDir": "/dev/shm/other-peer",
    "hostMonitor.peerTier.storeMedium": "memory",
    "hostMonitor.peerTier.cpuMillisecondsPerGiB": 2000,
    "hostMonitor.nvidiaSmi": "/usr/local/nvidia/bin/nvidia-smi",
    "hostMonitor.runtimeClassName": "nvidia",
    "hostMonitor.maxUnavailable": "10%",
    "hostMonitor.identity.mode": "kubernetes",
    "hostMonitor.identity.audience": "other-audience",
    "serviceAccount.name": "given",
    "serviceMonitor.interval": "10s",
    "grafana.dashboard.label": "team_dashboards",
    "prometheusRule.selector": 'service="rs"',
    "prometheusRule.goodputLow.threshold": 0.5,
    **{f"prometheusRule.{alert}.for": "7m" for alert in ALERTS},
    **{f"prometheusRule.{alert}.severity": "page" for alert in ALERTS},
    "tls.existingSecret": "given-tls",
    "tls.hostMonitorExistingSecret": "given-host-monitor-tls",
    "tls.certManager.issuerRef.name": "other-ca",
    "tls.certManager.issuerRef.kind": "ClusterIssuer",
    "tls.certManager.issuerRef.group": "issuers.example.com",
    "tls.certManager.duration": "720h",
    "tls.certManager.renewBefore": "240h",
    "supervisor.resources": {"requests": {"cpu": "1", "memory": "512Mi"}},
    "hostMonitor.resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
    "shadow.policy": "policies.examples.hot_swap_on_xid:HotSwapOnXid",
    "shadow.settings": {"heartbeat_timeout_s": 30.0},
    "shadow.database.url": "postgresql://shadow@db/x",
    "shadow.database.existingSecret": "other-shadow-pg",
    "shadow.database.existingSecretKey": "dsn",
    "shadow.tolerations": [{"key": "infra", "operator": "Exists"}],
    "relay.tolerations": [{"key": "infra", "operator": "Exists"}],
    "relay.priorityClassName": "system-cluster-critical",
}


def mutation(path: str, value: Any) -> Any:
    if path in MUTATIONS:
        return MUTATIONS[path]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2
    if isinstance(value, str) and path.startswith("auth."):
        return f"{path}-given-token"
    if isinstance(value, str) and re.fullmatch(r"\d+m|\d+(Mi|Gi)|\d+", value):
        return "3" if value != "3" else "4"  # a resource quantity
    if isinstance(value, dict):
        return {**value, "example.com/key": "value"}
    raise AssertionError(f"no mutation for {path}: add one to MUTATIONS")


def with_leaf(values: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(values)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


# Contexts in which optional parts are on; a value counts as used if changing it changes
# the rendered output in at least one of them. Tokens are fixed so renders compare.
CONTEXTS = [
    merged(POSTGRES, {"auth": TOKENS}),
    merged(SQLITE, {"auth": TOKENS}, {"shadow": {"enabled": True}}),  # its SQLite
    merged(INLINE_POLICY, {"auth": TOKENS}),
    merged(
        POSTGRES,
        {
            "auth": TOKENS,
            "hostMonitor": {"kernelLog": {"source": "file"}, "identity": {"mode": "kubernetes"}},
            "serviceMonitor": {"enabled": True},
            "grafana": {"dashboard": {"enabled": True}},
            "prometheusRule": {"enabled": True},
            "database": {"url": "", "existingSecret": "pg"},
            "supervisor": {"replicas": 1},
            # Its own PostgreSQL, from a Secret.
            "shadow": {"enabled": True, "database": {"existingSecret": "shadow-pg"}},
            # TLS off, but ready to be turned on.
            "tls": {"certManager": {"issuerRef": {"name": "team-ca"}}},
        },
    ),
    merged(CERT_MANAGER, {"auth": TOKENS}),
]


def _render_or_none(values: dict[str, Any]) -> dict[str, str] | None:
    try:
        return render_files(values)
    except helm.HelmError:
        return None


def test_every_value_is_used_by_a_template() -> None:
    baselines = [render_files(context) for context in CONTEXTS]
    unused = []
    for path, value in leaves(DEFAULT_VALUES):
        new = mutation(path, value)
        assert new != value, path
        if not any(
            (out := _render_or_none(with_leaf(context, path, new))) is not None and out != base
            for context, base in zip(CONTEXTS, baselines, strict=True)
        ):
            unused.append(path)
    assert unused == [], f"values no template uses: {unused}"


def commented_keys(lines: list[str]) -> set[str]:
    """Dotted paths of the keys of values.yaml that have a comment right above them."""
    stack: list[tuple[int, str]] = []
    found = set()
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
        if i > 0 and lines[i - 1].strip().startswith("#"):
            found.add(".".join(key for _, key in stack))
    return found


def test_every_value_is_documented_with_its_default() -> None:
    readme = (CHART / "README.md").read_text()
    commented = commented_keys((CHART / "values.yaml").read_text().splitlines())
    for path, value in leaves(DEFAULT_VALUES):
        shown = json.dumps(value) if not isinstance(value, str) else f'"{value}"'
        assert f"| `{path}` | `{shown}` |" in readme, f"chart README lacks {path} = {shown}"
        # In values.yaml: a comment above the key or above one of its parents.
        parts = path.split(".")
        prefixes = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
        assert prefixes & commented, f"values.yaml: no comment for {path}"


# --- the example JobSet -----------------------------------------------------------------------


def test_example_jobset_is_wired_to_the_host_monitor_and_the_worker_client() -> None:
    docs = render(merged(POSTGRES, {"workloadNamespace": "jobs"}))
    raw = (CHART / "examples" / "jobset.yaml").read_text()
    jobset = yaml.safe_load(raw.replace("RELEASE_NAMESPACE", NAMESPACE).replace("RELEASE", RELEASE))
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset["kind"] == "JobSet"
    # The failure policy the restart strategy expects: an evicted worker fails its Job at
    # once, and a failed Job restarts the JobSet, without using up maxRestarts when the
    # supervisor caused it.
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    assert policy["rules"] == [
        {
            "name": "restartsBySupervisor",
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "onJobFailureReasons": ["PodFailurePolicy"],
        }
    ]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job_spec = replicated["template"]["spec"]
    # What docs/kubernetes.md, "JobSet requirements", asks of a supervised JobSet.
    readme = (ROOT / "docs" / "kubernetes.md").read_text()
    section = readme.split("### JobSet requirements", 1)[1]
    required = yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])["spec"]
    rules = [{k: v for k, v in r.items() if k != "name"} for r in policy["rules"]]
    assert rules == required["failurePolicy"]["rules"]
    required_job = required["replicatedJobs"][0]["template"]["spec"]
    for key in ("backoffLimit", "podFailurePolicy"):
        assert job_spec[key] == required_job[key], key
    assert job_spec["parallelism"] == job_spec["completions"]
    restart = required_job["template"]["spec"]["restartPolicy"]
    assert job_spec["template"]["spec"]["restartPolicy"] == restart
    assert job_spec["backoffLimit"] == 0
    assert job_spec["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]
    # The Job template is a valid batch/v1 Job of a current Kubernetes.
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "w"}, "spec": job_spec}
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)

    pod = job_spec["template"]["spec"]
    # Training pods keep their own PID namespace: the host monitor translates the pid a
    # worker registers (host_monitor/pidns.py); only the DaemonSet has hostPID.
    assert "hostPID" not in pod and "hostIPC" not in pod and "hostNetwork" not in pod
    (trainer,) = pod["containers"]
    env = {v["name"]: v for v in trainer["env"]}
    hm_service = find(docs, "Service", f"{FULLNAME}-host-monitor")
    port = hm_service["spec"]["ports"][0]["port"]
    expected_url = f"http://{hm_service['metadata']['name']}.{NAMESPACE}.svc:{port}"
    assert env[worker_client.ENV_MONITOR_URL]["value"] == expected_url
    worker_secret = find(docs, "Secret", f"{FULLNAME}-worker-token")
    assert worker_secret["metadata"]["namespace"] == "jobs"  # where the JobSet runs
    assert env[worker_client.ENV_TOKEN]["valueFrom"]["secretKeyRef"] == {
        "name": worker_secret["metadata"]["name"],
        "key": "token",
    }
    # Rank and shape as the workload reads them. The backend rewrites NUM_DP_REPLICAS when
    # it rescales the JobSet: a fixed WORLD_SIZE would then contradict it.
    assert "WORLD_SIZE" not in env
    assert env[kube_objects.ENV_NUM_DP_REPLICAS]["value"] == str(replicated["replicas"])
    assert int(env["NUM_NODES_PER_DP"]["value"]) == job_spec["parallelism"]
    # The shape and bounds the Kubernetes backend reads from it.
    ours = {k for k in jobset["metadata"]["annotations"] if k.startswith(kube_objects.OURS)}
    assert ours <= {kube_objects.MIN_REPLICAS, kube_objects.MAX_REPLICAS, kube_objects.NODES_PER_DP}
    shape = kube_objects.job_shape(jobset, min_default=2, max_default=4, nodes_default=4)
    assert (shape.num_dp_replicas, shape.num_nodes_per_dp) == (2, 2)
    assert (shape.min_num_dp_replicas, shape.max_num_dp_replicas) == (1, 2)
    # Labels the JobSet controller sets, read through the downward API.
    labels = {
        v["valueFrom"]["fieldRef"]["fieldPath"]
        for v in trainer["env"]
        if "fieldRef" in v.get("valueFrom", {})
    }
    assert f"metadata.labels['{kube_objects.JOB_INDEX}']" in labels
    assert f"metadata.labels['{kube_objects.RESTART_ATTEMPT}']" in labels
    assert job_spec["completionMode"] == "Indexed"
    script = trainer["command"][-1]
    assert "RANK=$((JOB_INDEX * NUM_NODES_PER_DP + JOB_COMPLETION_INDEX))" in script
    module = script.rsplit("python -m ", 1)[1].split()[0]
    assert importlib.util.find_spec(module) is not None, module
