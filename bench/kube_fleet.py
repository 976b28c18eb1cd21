"""A fleet of kwok nodes on the tests' real control plane (tests/control_plane.py), for
`bench/kube_scale.py`: the API server keeps an audit log of the supervisor's requests,
the nodes and the JobSet are made with one client, and a node is made NotReady as a
gone kubelet leaves it.
"""

from __future__ import annotations

import importlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from supervisor.kube import objects as o
from tests.control_plane import KWOK_NODE_LABEL, KWOK_NODE_VALUE, ControlPlane, Identity
from tests.kube.harness import jobset

#: The workload namespace (as tests/kube_real.py's).
NS = "default"

#: Only the supervisor's requests are logged, each once it is answered (a watch: also
#: once it starts), with when it was received.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  users: ["{user}"]
- level: None
"""
GPU_CAPACITY = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}


def _chart_rbac() -> Any:
    # By name: it renders the chart with Helm (tests/test_helm_chart.py), a module that
    # mypy's run over bench/ does not type.
    return importlib.import_module("tests.chart_rbac")


def supervisor_user() -> str:
    """Who the supervisor is on the plane: the chart's ServiceAccount."""
    chart = importlib.import_module("tests.test_helm_chart")
    return f"system:serviceaccount:{chart.NAMESPACE}:{chart.FULLNAME}"


def supervisor_identity(plane: ControlPlane) -> Identity:
    """The chart's RBAC applied as Helm renders it, and a token of its ServiceAccount."""
    identity: Identity = _chart_rbac().chart_identity(plane, NS)
    return identity


@dataclass
class AuditedPlane(ControlPlane):
    """The tests' control plane, its API server logging the supervisor's requests, its
    node controller waiting an hour for a silent node."""

    @property
    def audit_log(self) -> str:
        return str(self.work / "audit.log")

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Any:
        if name == "kube-apiserver":
            policy = self.work / "audit-policy.yaml"
            policy.write_text(AUDIT_POLICY.format(user=supervisor_user()))
            args = [
                *args,
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-mode=blocking",  # each line written as the request ends
                "--audit-log-maxsize=0",
            ]
        if name == "kube-controller-manager":
            # kwok's nodes post a heartbeat every 10 minutes and renew no Lease: after
            # the default grace (50 s) the node controller turned them all Unknown, and
            # the supervisor remedied each. NotReady here is what the bench writes.
            args = [*args, "--node-monitor-grace-period=1h"]
        return super()._start(name, args, env)

    def audit_lines(self) -> list[str]:
        try:
            with open(self.audit_log, encoding="utf-8", errors="replace") as f:
                return f.readlines()
        except FileNotFoundError:
            return []


def create_nodes(plane: ControlPlane, pool: str, count: int) -> list[str]:
    """`count` kwok nodes of 8 GPUs labelled pool=`pool` (one client, 8 at a time: a
    client per node would cost a TLS context each)."""
    names = [f"{pool}-{i}" for i in range(count)]

    def create(api: httpx.Client, name: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {KWOK_NODE_LABEL: KWOK_NODE_VALUE, "pool": pool},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            },
            "status": {"allocatable": GPU_CAPACITY, "capacity": GPU_CAPACITY},
        }
        r = api.post("/api/v1/nodes", json=body)
        if r.status_code not in (201, 409):
            raise RuntimeError(f"node {name}: {r.status_code} {r.text}")

    with plane.client() as api, ThreadPoolExecutor(8) as pool_:
        list(pool_.map(lambda n: create(api, n), names))
    return names


def _list(plane: ControlPlane, path: str, selector: str) -> list[dict[str, Any]]:
    with plane.client() as api:
        r = api.get(path, params={"labelSelector": selector}, timeout=120)
    r.raise_for_status()
    return list(r.json()["items"])


def ready_nodes(plane: ControlPlane, pool: str) -> int:
    return sum(1 for n in _list(plane, "/api/v1/nodes", f"pool={pool}") if o.node_ready(n))


def running_pods(plane: ControlPlane, jobset: str) -> list[dict[str, Any]]:
    pods = _list(plane, f"/api/v1/namespaces/{NS}/pods", f"{o.JOBSET_NAME}={jobset}")
    return [
        p
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def wait_for(what: str, check: Any, within_s: float, period_s: float = 2.0) -> float:
    """Poll `check()` until it is true; the seconds it took."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within_s:
            raise RuntimeError(f"not within {within_s:.0f} s: {what}")
        time.sleep(period_s)
    return time.monotonic() - started


def start_workload(plane: ControlPlane, name: str, pool: str, pods: int) -> None:
    """The JobSet of "JobSet requirements" (tests/kube/harness.py) of `pods` pods of a
    whole node each on the nodes of `pool` (one Job, parallelism `pods`)."""
    body = jobset(name, replicas=1, parallelism=pods)
    body["metadata"]["namespace"] = NS
    pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"pool": pool}
    plane.apply(body)


def set_not_ready(plane: ControlPlane, node: str) -> float:
    """kwok stops playing the node's kubelet, then its Ready condition turns False, as a
    node controller sees a kubelet that stopped posting. Returns when (epoch seconds)
    the status write was sent."""
    with plane.client() as api:
        r = api.patch(
            f"/api/v1/nodes/{node}",
            json={"metadata": {"labels": {KWOK_NODE_LABEL: None}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        r.raise_for_status()
        time.sleep(1.0)  # kwok lets go of it
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {
            "type": "Ready",
            "status": "False",
            "reason": "KubeletNotReady",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        sent = time.time()
        r = api.patch(
            f"/api/v1/nodes/{node}/status",
            json={"status": {"conditions": [condition]}},
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
        r.raise_for_status()
    return sent
