"""The real control plane under the Kubernetes tests (tests/control_plane.py): a JobSet
given to the real API server is defaulted by the JobSet controller's webhook, made into
Jobs by that controller, into pods by the Job controller, placed by the scheduler on
kwok's nodes and run to their end there (kwok plays their kubelets), and the JobSet
completes; the API server's RBAC refuses a user it does not know of; the supervisor's
Kubernetes backend works under the chart's RBAC."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from supervisor.domain import ActionType
from supervisor.kube.backend import KubeBackend
from supervisor.kube.client import api_client
from tests.chart_rbac import chart_identity
from tests.conftest import SettingsFactory
from tests.control_plane import KWOK_NODE_LABEL, KWOK_NODE_VALUE, RUN_TO_COMPLETION, ControlPlane
from tests.kube.harness import Hooks, action, jobset, kube_settings
from tests.timing import scaled, wait_until


def kwok_node(name: str, pool: str = "gpu") -> dict[str, Any]:
    """A kwok node in `pool` (label pool=`pool`): the control plane is the session's, and
    each test keeps its pods on nodes of its own."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {KWOK_NODE_LABEL: KWOK_NODE_VALUE, "gpu": "true", "pool": pool},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
        },
    }


def test_a_jobset_is_run_by_the_real_controllers_on_kwok_nodes(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    for name in ("kwok-0", "kwok-1"):
        control_plane.apply(kwok_node(name, pool="smoke"))
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "pretrain", "namespace": "default"},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "parallelism": 1,
                            "completions": 1,
                            "backoffLimit": 0,
                            "template": {
                                # kwok runs it to its end (tests/kwok_pod_stages.yaml).
                                "metadata": {"annotations": {RUN_TO_COMPLETION: "true"}},
                                "spec": {
                                    "restartPolicy": "Never",
                                    "nodeSelector": {"pool": "smoke"},
                                    "containers": [{"name": "train", "image": "trainer"}],
                                },
                            },
                        }
                    },
                }
            ]
        },
    }
    control_plane.apply(jobset)
    with control_plane.client() as api:
        # The webhook defaulted it (the controller's own mutating webhook).
        got = api.get("/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/pretrain")
        assert got.status_code == 200, got.text
        assert got.json()["spec"]["successPolicy"]["operator"] == "All"

        def jobs() -> list[dict[str, Any]]:
            r = api.get(
                "/apis/batch/v1/namespaces/default/jobs",
                params={"labelSelector": "jobset.sigs.k8s.io/jobset-name=pretrain"},
            )
            return list(r.json()["items"])

        assert (
            len(wait_until(lambda: len(jobs()) == 2 and jobs(), "the JobSet's two Jobs", 60)) == 2
        )

        def pods() -> list[dict[str, Any]]:
            r = api.get(
                "/api/v1/namespaces/default/pods",
                params={"labelSelector": "jobset.sigs.k8s.io/jobset-name=pretrain"},
            )
            return list(r.json()["items"])

        def succeeded() -> list[dict[str, Any]]:
            done = [p for p in pods() if p["status"].get("phase") == "Succeeded"]
            return done if len(done) == 2 else []

        ran = wait_until(
            succeeded, "two pods run to their end on kwok nodes (kwok plays their kubelets)", 60
        )
        assert {p["spec"]["nodeName"] for p in ran} <= {"kwok-0", "kwok-1"}

        def completed() -> bool:
            r = api.get("/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/pretrain")
            conditions = r.json().get("status", {}).get("conditions", [])
            return any(c["type"] == "Completed" and c["status"] == "True" for c in conditions)

        wait_until(completed, "the JobSet completed (its success policy: every Job)", 60)


def test_a_user_rbac_does_not_know_is_refused(control_plane: ControlPlane) -> None:
    stranger = control_plane.identity("stranger")
    with control_plane.client(stranger) as api:
        r = api.get("/api/v1/nodes")
    assert r.status_code == 403, r.text
    assert 'User "stranger" cannot list resource "nodes"' in r.json()["message"]


# --- the supervisor's Kubernetes backend, held to the chart's RBAC ----------------------------


async def test_the_supervisor_under_the_charts_rbac_sees_the_cluster_and_cordons(
    control_plane: ControlPlane, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    """The chart's ServiceAccount, Roles and bindings, as Helm renders them, applied to the
    real API server; the backend runs with that ServiceAccount's token, not as admin: its
    informers list and watch, it sees the JobSet and the GPU nodes, and a cordon passes
    RBAC and lands on the node."""
    who = chart_identity(control_plane)
    for name in ("gpu-0", "gpu-1"):
        control_plane.apply(kwok_node(name))
    control_plane.apply(
        {
            **jobset("train", replicas=2, gpus=0),
            "metadata": {"name": "train", "namespace": "default"},
        }
    )
    settings = kube_settings(
        make_settings, kube_config=str(who.kubeconfig), kube_namespace="default"
    )
    backend = KubeBackend(settings, api_client(settings), request_timeout_s=10.0)
    hooks = Hooks()
    await backend.start(hooks.hooks())
    try:
        deadline = time.monotonic() + scaled(60)
        while not ({"gpu-0", "gpu-1"} <= set(backend.cluster_nodes()) and backend.job_views()):
            assert time.monotonic() < deadline, (backend.cluster_nodes(), backend.job_views())
            await asyncio.sleep(0.2)
        assert "train" in backend.job_views()
        result = await backend.execute(action(ActionType.CORDON, node="gpu-1", job=None))
        assert result, result
        with control_plane.client() as api:
            node = api.get("/api/v1/nodes/gpu-1").json()
        assert node["spec"].get("unschedulable") is True
    finally:
        await backend.close()
