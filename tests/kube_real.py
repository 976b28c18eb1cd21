"""What the tests on the real control plane share (tests/control_plane.py): nodes of a
pool of their own, a JobSet on them, reads as the admin, and the Kubernetes backend as the
chart's ServiceAccount seeing that pool as its GPU nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from supervisor.config import Settings
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.kube.client import api_client
from tests.conftest import SettingsFactory
from tests.control_plane import KWOK_NODE_LABEL, KWOK_NODE_VALUE, ControlPlane, Identity
from tests.kube.harness import Hooks, jobset, kube_settings
from tests.timing import scaled, wait_until

NS = "default"
JOBSETS = f"/apis/{o.JOBSET_API_VERSION}/namespaces/{NS}/jobsets"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


def pool_nodes(plane: ControlPlane, pool: str, count: int) -> list[str]:
    """`count` kwok nodes of 8 GPUs, labelled pool=`pool`."""
    names = [f"{pool}-{i}" for i in range(count)]
    for name in names:
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
        plane.apply(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {KWOK_NODE_LABEL: KWOK_NODE_VALUE, "pool": pool},
                    "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                },
                "status": {"allocatable": capacity, "capacity": capacity},
            }
        )
    return names


def start_jobset(
    plane: ControlPlane, name: str, pool: str, labels: dict[str, str] | None = None, **js: Any
) -> dict[str, Any]:
    """The JobSet of "JobSet requirements" (tests/kube/harness.py), one pod of 8 GPUs per
    node of `pool`, created on the real API server (with `labels` besides its own)."""
    body = jobset(name, **js)
    body["metadata"]["namespace"] = NS
    body["metadata"]["labels"].update(labels or {})
    pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"pool": pool}
    plane.apply(body)
    return body


def running_jobset(
    plane: ControlPlane, name: str, nodes: int = 2, **js: Any
) -> list[dict[str, Any]]:
    """`nodes` nodes in the pool `name` and the JobSet `name` (of two replicas unless `js`
    says otherwise) running on them: its pods, of restart attempt 0."""
    pool_nodes(plane, name, nodes)
    start_jobset(plane, name, name, **js)
    return wait_running(plane, name, js.get("replicas", 2), "0")


def get(plane: ControlPlane, path: str) -> dict[str, Any] | None:
    with plane.client() as api:
        r = api.get(path)
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    found: dict[str, Any] = r.json()
    return found


def pods_of(plane: ControlPlane, name: str) -> list[dict[str, Any]]:
    found = get(plane, f"/api/v1/namespaces/{NS}/pods?labelSelector={o.JOBSET_NAME}%3D{name}")
    assert found is not None
    return list(found["items"])


def live_jobs(plane: ControlPlane, name: str) -> list[dict[str, Any]]:
    """The JobSet's child Jobs, none being deleted."""
    found = get(plane, f"{JOBS}?labelSelector={o.JOBSET_NAME}%3D{name}") or {}
    return [j for j in found["items"] if not j["metadata"].get("deletionTimestamp")]


def job_uids(plane: ControlPlane, name: str) -> set[str]:
    """The UIDs of the JobSet's child Jobs, none being deleted."""
    return {j["metadata"]["uid"] for j in live_jobs(plane, name)}


def running(plane: ControlPlane, name: str, count: int, attempt: str | None = None) -> Any:
    """The JobSet's `count` running pods (of restart attempt `attempt`), else None."""
    pods = [
        p
        for p in pods_of(plane, name)
        if p["status"].get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and (attempt is None or p["metadata"]["labels"].get(o.RESTART_ATTEMPT) == attempt)
    ]
    return pods if len(pods) == count else None


def wait_running(
    plane: ControlPlane, name: str, count: int, attempt: str | None = None
) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = wait_until(
        lambda: running(plane, name, count, attempt),
        f"{count} running pods of {name} (restart attempt {attempt})",
        60,
    )
    return pods


def events_about(plane: ControlPlane, name: str, reason: str) -> list[dict[str, Any]]:
    found = get(plane, f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name%3D{name}")
    assert found is not None
    return [e for e in found["items"] if e["reason"] == reason]


def node(plane: ControlPlane, name: str) -> dict[str, Any]:
    found = get(plane, f"/api/v1/nodes/{name}")
    assert found is not None
    return found


def real_settings(
    who: Identity, make_settings: SettingsFactory, pool: str, **overrides: Any
) -> Settings:
    """Settings of the backend as `who`, seeing the nodes of `pool` as its GPU nodes."""
    values: dict[str, Any] = {
        "kube_config": str(who.kubeconfig),
        "kube_namespace": NS,
        "kube_gpu_node_selector": f"pool={pool}",
        # Pods end through three processes here (kwok, the Job controller, the API
        # server): on a loaded machine, more than the fake server's 10 s.
        "pod_termination_threshold_s": scaled(60),
        "controller_patience_s": scaled(60),
        **overrides,
    }
    return kube_settings(make_settings, **values)


def real_backend(settings: Settings) -> KubeBackend:
    """The backend with the short watches, backoffs and patience of a test."""
    return KubeBackend(
        settings,
        api_client(settings),
        request_timeout_s=10.0,
        watch_timeout_s=30,
        api_backoff_s=(0.05, 0.5),
        eviction_patience_s=2.0,
    )


@asynccontextmanager
async def backend_on(
    plane: ControlPlane,
    who: Identity,
    make_settings: SettingsFactory,
    pool: str,
    hooks: Hooks | None = None,
    **overrides: Any,
) -> AsyncIterator[KubeBackend]:
    """The backend as the chart's ServiceAccount, seeing the nodes of `pool` as its GPU
    nodes; started, then closed."""
    backend = real_backend(real_settings(who, make_settings, pool, **overrides))
    await backend.start((hooks or Hooks()).hooks())
    try:
        yield backend
    finally:
        await backend.close()


async def until(backend: KubeBackend, predicate: Callable[[], Any], what: str) -> None:
    assert await backend.discovery.wait_until(predicate, scaled(30)), what


def fail_pod(plane: ControlPlane, pod: dict[str, Any]) -> None:
    """The pod's container exits 1 and its kubelet reports it: the pod is Failed."""
    container = pod["spec"]["containers"][0]
    terminated = {"exitCode": 1, "reason": "Error", "startedAt": pod["status"]["startTime"]}
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": {**terminated, "finishedAt": terminated["startedAt"]}},
            }
        ],
    }
    merge_patch(
        plane, f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}/status", {"status": status}
    )


def merge_patch(plane: ControlPlane, path: str, body: dict[str, Any]) -> None:
    """A JSON merge patch of `path`, as the admin."""
    with plane.client() as api:
        r = api.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"})
    assert r.status_code == 200, r.text


def unmanage(plane: ControlPlane, node: str) -> None:
    """kwok stops playing the node's kubelet: its pods are left as a gone kubelet leaves
    them."""
    merge_patch(plane, f"/api/v1/nodes/{node}", {"metadata": {"labels": {KWOK_NODE_LABEL: None}}})


def set_ready(plane: ControlPlane, node: str, ready: bool) -> None:
    """The node's Ready condition True or False, as its kubelet posts it."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletNotReady",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    with plane.client() as api:
        r = api.patch(
            f"/api/v1/nodes/{node}/status",
            json={"status": {"conditions": [condition]}},
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
    assert r.status_code == 200, r.text


def add_taint(plane: ControlPlane, name: str, taint: dict[str, Any]) -> None:
    """Add `taint` to the node, as the admin: read, then write with the resourceVersion
    read (the node lifecycle controller writes the node's taints too: a write on a stale
    copy would drop its own, so a conflict reads again)."""
    while True:
        now = node(plane, name)
        taints = [*(now["spec"].get("taints") or []), taint]
        body = {"metadata": {"resourceVersion": now["metadata"]["resourceVersion"]}}
        with plane.client() as api:
            r = api.patch(
                f"/api/v1/nodes/{name}",
                json={**body, "spec": {"taints": taints}},
                headers={"Content-Type": "application/merge-patch+json"},
            )
        if r.status_code != 409:
            assert r.status_code == 200, r.text
            return
