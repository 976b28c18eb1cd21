"""The chart's heartbeat relays (templates/relay.yaml), rendered by Helm as
tests/test_helm_chart.py renders the chart: a Deployment whose command the relay's own
parser takes, the host monitors pointed at its Service, and its credential: the agent
token (identity mode shared), or a token of its own ServiceAccount that the supervisor's
settings name as a relay's (mode kubernetes; what the supervisor then accepts of it is
tests/test_agent_identity_real.py's, on the real API server).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from host_monitor.relay import _parser as relay_parser
from tests.test_helm_chart import (
    CERT_MANAGER,
    FULLNAME,
    KUBE_IDENTITY,
    NAMESPACE,
    POSTGRES,
    RELAY,
    TLS_DIR,
    certificates,
    container,
    find,
    host_monitor_settings,
    merged,
    render,
    supervisor_settings,
)

RELAY_URL = f"http://{RELAY}.{NAMESPACE}.svc:9310"
SUPERVISOR_URL = f"http://{FULLNAME}.{NAMESPACE}.svc:8080"


def relay_args(docs: list[dict[str, Any]]) -> Any:
    """The relay's command, read by the relay's own parser."""
    command = container(docs, "Deployment", RELAY)["command"]
    assert command[:2] == ["host-monitor", "relay"]
    return relay_parser().parse_args(command[2:])


def pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, "Deployment", RELAY)["spec"]["template"]["spec"]
    return spec


def test_relays_carry_the_host_monitors_heartbeats_with_the_agent_token() -> None:
    docs = render(POSTGRES)
    args = relay_args(docs)
    assert (args.supervisor_url, args.port, args.interval_ms) == (SUPERVISOR_URL, 9310, 100.0)
    assert find(docs, "Deployment", RELAY)["spec"]["replicas"] == 2
    # Host monitors send to the relays' Service; directly to the supervisor when they fail.
    hm = host_monitor_settings(docs)
    assert (hm.heartbeat_relay_url, hm.supervisor_url) == (RELAY_URL, SUPERVISOR_URL)
    service = find(docs, "Service", RELAY)
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9310, "targetPort": "http", "protocol": "TCP"}
    ]
    assert (
        service["spec"]["selector"].items()
        <= (
            pod_labels := find(docs, "Deployment", RELAY)["spec"]["template"]["metadata"]["labels"]
        ).items()
    )
    assert pod_labels["app.kubernetes.io/component"] == "heartbeat-relay"
    # Identity mode shared: the agent token, as a file the relay reads again on rotation.
    spec = pod(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["credential"]["secret"] == {
        "secretName": f"{FULLNAME}-tokens",
        "defaultMode": 0o440,
        "items": [{"key": "agent-token", "path": "token"}],
    }
    assert args.credential_file == "/var/run/secrets/resiliency-supervisor/token"
    # No API access, no privilege.
    assert spec["automountServiceAccountToken"] is False
    assert find(docs, "ServiceAccount", RELAY)["automountServiceAccountToken"] is False
    assert not [
        d
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s.get("name") == RELAY for s in d.get("subjects", []))
    ]
    c = container(docs, "Deployment", RELAY)
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}


def test_with_kubernetes_identity_a_relay_has_its_own_token_that_speaks_for_no_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(KUBE_IDENTITY)
    volumes = {v["name"]: v for v in pod(docs)["volumes"]}
    assert volumes["credential"]["projected"]["sources"] == [
        {
            "serviceAccountToken": {
                "audience": "resiliency-supervisor",
                "expirationSeconds": 600,
                "path": "token",
            }
        }
    ]
    assert pod(docs)["serviceAccountName"] == RELAY
    settings = supervisor_settings(docs, tmp_path, monkeypatch)
    assert settings.agent_kube_relay_service_account == (
        f"system:serviceaccount:{NAMESPACE}:{RELAY}"
    )
    assert settings.agent_kube_service_account == (
        f"system:serviceaccount:{NAMESPACE}:{FULLNAME}-host-monitor"
    )


def test_with_tls_relays_serve_the_host_monitors_certificate_which_names_them() -> None:
    docs = render(CERT_MANAGER)
    args = relay_args(docs)
    assert args.supervisor_url == f"https://{FULLNAME}.{NAMESPACE}.svc:8080"
    assert (args.tls_cert_file, args.tls_key_file, args.tls_ca_file) == (
        f"{TLS_DIR}/tls.crt",
        f"{TLS_DIR}/tls.key",
        f"{TLS_DIR}/ca.crt",
    )
    volumes = {v["name"]: v for v in pod(docs)["volumes"]}
    hm_secret = f"{FULLNAME}-host-monitor-tls"
    assert volumes["tls"]["secret"]["secretName"] == hm_secret
    # Host monitors check the relay against the relays' Service: the certificate names it.
    assert f"{RELAY}.{NAMESPACE}.svc" in certificates(docs)[hm_secret]["dnsNames"]
    assert host_monitor_settings(docs).heartbeat_relay_url == RELAY_URL.replace("http", "https")
    probe = container(docs, "Deployment", RELAY)["readinessProbe"]["httpGet"]
    assert probe["scheme"] == "HTTPS"


def test_relays_off_leave_no_trace() -> None:
    off = merged(KUBE_IDENTITY, {"relay": {"enabled": False}})
    docs = render(off)
    assert not [d for d in docs if d["metadata"]["name"] == RELAY]
    assert host_monitor_settings(docs).heartbeat_relay_url is None
    settings = find(docs, "ConfigMap", f"{FULLNAME}-settings")["data"]["settings.yaml"]
    assert "agent_kube_relay_service_account" not in settings
    # Nor with the host monitors off: relays serve only them.
    no_monitors = render(merged(POSTGRES, {"hostMonitor": {"enabled": False}}))
    assert not [d for d in no_monitors if d["metadata"]["name"] == RELAY]
