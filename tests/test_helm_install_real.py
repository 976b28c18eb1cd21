"""The whole chart, as Helm renders it (tests/test_helm_chart.py's values), installed on
the real API server (tests/control_plane.py) and removed again: every object accepted
with strict field validation, the supervisor's pods, the host monitor's and the heartbeat
relays' placed by the real scheduler and controllers on kwok nodes, and nothing left after
the uninstall.

A release of its own namespace per set of values; its GPU nodes (`pool=chart`, labelled
`nvidia.com/gpu.present`) are the only ones its DaemonSet selects, and its supervisor pods
are kept to them (`supervisor.nodeSelector`). kwok plays every pod's kubelet: it runs no
container, so what shows here is the objects and their placement, not the processes (the
end-to-end modules run those).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.control_plane import ControlPlane, object_path
from tests.kube_real import get, merge_patch, pool_nodes
from tests.test_helm_chart import KUBE_IDENTITY, POSTGRES, SHADOW_ON, SQLITE, merged, render
from tests.timing import scaled

POOL = "chart"
GPU_NODES = 2
#: The claim of the SQLite set binds to a volume the test makes (no provisioner here).
VOLUME = "chart-sqlite"
NAMESPACED = (
    "ConfigMap",
    "DaemonSet",
    "Deployment",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "Role",
    "RoleBinding",
    "Secret",
    "Service",
    "ServiceAccount",
)


def until(predicate: Callable[[], Any], what: str, within: float = 60.0) -> Any:
    deadline = time.monotonic() + scaled(within)
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.2)
    return value


def gpu_nodes(plane: ControlPlane) -> list[str]:
    names = pool_nodes(plane, POOL, GPU_NODES)
    for name in names:
        merge_patch(
            plane,
            f"/api/v1/nodes/{name}",
            {"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}},
        )
    return names


def volume(plane: ControlPlane) -> None:
    plane.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": VOLUME},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": "/var/lib/supervisor-test"},
            },
        }
    )


def pods(plane: ControlPlane, namespace: str, component: str) -> list[dict[str, Any]]:
    found = get(
        plane,
        f"/api/v1/namespaces/{namespace}/pods"
        f"?labelSelector=app.kubernetes.io/component%3D{component}",
    )
    assert found is not None
    items: list[dict[str, Any]] = found["items"]
    return items


def running_on(plane: ControlPlane, namespace: str, component: str, count: int) -> list[str]:
    """The nodes of `count` Running pods of `component`, once there are that many."""

    def placed() -> list[str] | None:
        live = [
            p
            for p in pods(plane, namespace, component)
            if p["status"].get("phase") == "Running" and "deletionTimestamp" not in p["metadata"]
        ]
        return [p["spec"]["nodeName"] for p in live] if len(live) == count else None

    nodes: list[str] = until(placed, f"{count} {component} pods running in {namespace}")
    return nodes


@pytest.mark.parametrize(
    ("values", "supervisors"),
    [
        pytest.param(POSTGRES, {"supervisor": 2}, id="postgresql"),
        pytest.param(SQLITE, {"supervisor": 1}, id="sqlite"),
        pytest.param(KUBE_IDENTITY, {"supervisor": 2}, id="kubernetes-identity"),
        pytest.param(SHADOW_ON, {"supervisor": 2, "shadow-supervisor": 1}, id="shadow"),
    ],
)
def test_the_chart_installs_runs_its_pods_and_uninstalls(
    control_plane: ControlPlane,
    values: dict[str, Any],
    supervisors: dict[str, int],
    request: pytest.FixtureRequest,
) -> None:
    namespace = f"chart-{request.node.callspec.id}"
    nodes = gpu_nodes(control_plane)
    volume(control_plane)
    kept = {"nodeSelector": {"pool": POOL}}
    docs = render(merged(values, {"supervisor": kept, "relay": kept}), namespace)
    unknown = {d["kind"] for d in docs} - set(NAMESPACED) - {"ClusterRole", "ClusterRoleBinding"}
    assert not unknown, f"kinds this test does not know how to install: {unknown}"
    control_plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    try:
        for doc in docs:
            if doc["kind"] in NAMESPACED:
                doc["metadata"].setdefault("namespace", namespace)
            control_plane.apply(doc, strict=True)

        # The host monitor on each GPU node and on nothing else; the supervisor's replicas
        # (and the shadow's) and the heartbeat relays on the release's nodes.
        assert sorted(running_on(control_plane, namespace, "host-monitor", GPU_NODES)) == nodes
        for component, count in {**supervisors, "heartbeat-relay": 2}.items():
            placed = running_on(control_plane, namespace, component, count)
            assert set(placed) <= set(nodes), (component, placed)
        if values is SQLITE:  # its claim bound by the real volume controller
            claims = get(control_plane, f"/api/v1/namespaces/{namespace}/persistentvolumeclaims")
            assert claims is not None
            assert [c["spec"].get("volumeName") for c in claims["items"]] == [VOLUME], claims
    finally:
        uninstall(control_plane, namespace, docs)


def uninstall(plane: ControlPlane, namespace: str, docs: list[dict[str, Any]]) -> None:
    """Every object of the release deleted, as `helm uninstall` does, then its namespace;
    nothing of it left."""
    with plane.client() as api:
        for doc in docs:
            path = _object_path(doc, namespace)
            r = api.delete(path)
            assert r.status_code in (200, 202, 404), (path, r.text)
        r = api.delete(f"/api/v1/namespaces/{namespace}")
        assert r.status_code in (200, 202), r.text
        for doc in docs:
            if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                assert api.get(_object_path(doc, namespace)).status_code == 404
        r = api.delete(f"/api/v1/persistentvolumes/{VOLUME}")
        assert r.status_code in (200, 202, 404), r.text
    until(lambda: get(plane, f"/api/v1/namespaces/{namespace}") is None, f"{namespace} gone", 120)
    until(lambda: get(plane, f"/api/v1/persistentvolumes/{VOLUME}") is None, "the volume gone", 60)


def _object_path(doc: dict[str, Any], namespace: str) -> str:
    body = {**doc, "metadata": {**doc["metadata"]}}
    if doc["kind"] in NAMESPACED:
        body["metadata"].setdefault("namespace", namespace)
    return object_path(body)
