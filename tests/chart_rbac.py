"""The chart's ServiceAccount, Roles and bindings, as Helm renders them, applied to the
real control plane; an identity that holds that ServiceAccount's token, as the
supervisor's pod does."""

from __future__ import annotations

from typing import Any

from tests.control_plane import ControlPlane, Identity
from tests.test_helm_chart import FULLNAME, NAMESPACE, POSTGRES, merged, render

RBAC_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}


def chart_identity(plane: ControlPlane, workload_namespace: str = "default") -> Identity:
    """Apply the chart's RBAC (idempotent: server-side apply) and return an identity with
    a fresh token of its ServiceAccount (TokenRequest), in `workload_namespace`."""
    docs = render(merged(POSTGRES, {"workloadNamespace": workload_namespace}))
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for doc in docs:
        if doc["kind"] in RBAC_KINDS:
            plane.apply(doc)
    return plane.token_identity(
        "supervisor", service_account_token(plane, FULLNAME), namespace=workload_namespace
    )


def chart_identity_without(
    plane: ControlPlane,
    resource: str,
    verb: str,
    workload_namespace: str = "default",
    name: str | None = None,
    values: dict[str, Any] | None = None,
) -> Identity:
    """A ServiceAccount of its own (`name`) holding the chart's RBAC (rendered with
    `values`, a PostgreSQL install by default) less `verb` on `resource` (as a cluster
    admin might trim it); an identity with its token."""
    name = name or f"{FULLNAME}-without-{resource.replace('/', '-')}-{verb}"
    docs = render(merged(values or POSTGRES, {"workloadNamespace": workload_namespace}))
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    subject = {"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}
    plane.apply(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": NAMESPACE},
        }
    )
    for doc in docs:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        rules = []
        for rule in doc["rules"]:
            kept = dict(rule)
            if resource in rule.get("resources", []):
                kept["verbs"] = [v for v in rule["verbs"] if v != verb]
            if kept["verbs"]:
                rules.append(kept)
        meta = {"name": f"{name}-{doc['metadata']['name']}"}
        if doc["kind"] == "Role":
            meta["namespace"] = doc["metadata"]["namespace"]
        plane.apply({**doc, "metadata": meta, "rules": rules})
        binding = "RoleBinding" if doc["kind"] == "Role" else "ClusterRoleBinding"
        plane.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": binding,
                "metadata": meta,
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": doc["kind"],
                    "name": meta["name"],
                },
                "subjects": [subject],
            }
        )
    return plane.token_identity(
        name, service_account_token(plane, name), namespace=workload_namespace
    )


def service_account_token(plane: ControlPlane, name: str) -> str:
    """A fresh token of the ServiceAccount `name` of the chart's namespace (TokenRequest),
    as its pod would have mounted."""
    with plane.client() as api:
        r = api.post(
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{name}/token",
            json={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3600},
            },
        )
    assert r.status_code == 201, r.text
    token: str = r.json()["status"]["token"]
    return token
