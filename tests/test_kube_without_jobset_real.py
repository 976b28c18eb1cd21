"""A cluster where JobSet was never installed: `supervisor serve` with the Kubernetes
backend against a real API server (etcd and kube-apiserver of tests/control_plane.py,
started without the JobSet CRD and controller: the CRD is cluster-wide, so the session's
plane cannot lose it), as the chart's ServiceAccount. The supervisor must start and stay
up (a restart would meet the same cluster: a crash loop), say at start what is missing,
record an operator's action and fail it with the same words, shown by the API and the
CLI, and keep what it recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.kube import objects as o
from tests.chart_rbac import chart_identity
from tests.control_plane import ControlPlane
from tests.http import http
from tests.test_host_monitor import (
    ACTUATOR_TOKEN,
    OPERATOR,
    OPERATOR_TOKEN,
    Cluster,
    Supervisor,
    wait_for,
)
from tests.test_ops_cli import cli, ok
from tests.timing import scaled

CRD = f"{o.JOBSET_PLURAL}.{o.JOBSET_GROUP}"
NODE = "nojobset-gpu-0"


class PlaneWithoutJobSet(ControlPlane):
    """etcd and kube-apiserver alone (a few seconds): no JobSet CRD, no controller."""

    def start(self, within: float = 120.0) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.ca.cert_pem.write_to_path(str(self.work / "ca.crt"))
        self._start_etcd(within)
        self._start_apiserver(within)
        self.admin = self.identity("admin", "system:masters")


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    bare = PlaneWithoutJobSet(tmp_path / "plane")
    try:
        bare.start(within=scaled(120))
        yield bare
    finally:
        bare.stop()


def test_a_cluster_without_the_jobset_crd_fails_actions_naming_it(
    plane: ControlPlane, tmp_path: Path
) -> None:
    with plane.client() as api:
        crds = api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions").json()
    assert CRD not in {c["metadata"]["name"] for c in crds["items"]}
    who = chart_identity(plane, "default")
    supervisor = Supervisor(
        tmp_path,
        env={
            "SUPERVISOR_BACKEND": "kubernetes",
            "SUPERVISOR_KUBE_CONFIG": str(who.kubeconfig),
            "SUPERVISOR_KUBE_NAMESPACE": "default",
            "SUPERVISOR_KUBE_GPU_NODE_SELECTOR": "gpu=true",
            "SUPERVISOR_HOST_MONITOR_ACTUATOR_TOKEN": ACTUATOR_TOKEN,
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": "0.3",
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": "1.5",
            "SUPERVISOR_ACTION_TIMEOUT_S": "30",
            "SUPERVISOR_ACTION_RETRY_BACKOFF_S": "0.2",
        },
    )
    cluster = Cluster(tmp_path)
    try:
        supervisor.start()
        cluster.start_agent(supervisor.url, node=NODE, heartbeat_polling_period_s=0.3)
        wait_for(lambda: (supervisor.node(NODE) or {}).get("state") == "spare", 20, "a spare")

        r = http.post(
            f"{supervisor.url}/api/v1/actions",
            json={"type": "cordon", "node": NODE, "reason": "maintenance"},
            headers={**OPERATOR, "Idempotency-Key": "cordon-without-jobset"},
        )
        assert r.status_code == 202, r.text
        action_id = r.json()["id"]

        def settled() -> dict[str, Any] | None:
            got = supervisor.http.get(f"/api/v1/actions/{action_id}").json()
            return got if got["status"] in ("succeeded", "failed") else None

        action = wait_for(settled, 40, "the cordon settled")
        assert action["status"] == "failed", action
        assert CRD in action["error"] and "not installed" in action["error"], action
        # Failed once, at once: no retries against a cluster that cannot change by itself.
        assert action["attempts"] == 1, action

        # What the user reads: the API's list and the CLI.
        listed = supervisor.http.get("/api/v1/actions").json()["items"]
        assert [a["id"] for a in listed] == [action_id]
        env = {"SUPERVISOR_URL": supervisor.url, "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN}
        shown = json.loads(
            ok(cli(tmp_path, "describe", "action", str(action_id), "-o", "json", **env))
        )
        assert CRD in shown["error"], shown
        assert CRD in ok(cli(tmp_path, "describe", "action", str(action_id), **env))

        # Still up and serving, nothing it recorded lost: the node and the action stay.
        assert supervisor.proc is not None and supervisor.proc.poll() is None
        assert http.get(f"{supervisor.url}/readyz").status_code == 200
        assert (supervisor.node(NODE) or {}).get("state") == "spare"
        assert supervisor.http.get(f"/api/v1/actions/{action_id}").json()["status"] == "failed"
        log = supervisor.log.read_text()
        said = [line for line in log.splitlines() if CRD in line and "not installed" in line]
        assert said, log[-3000:]
    finally:
        supervisor.stop()
        cluster.teardown()
