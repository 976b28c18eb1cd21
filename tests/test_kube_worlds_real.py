"""Worlds on the Kubernetes backend, on the real control plane (tests/control_plane.py): a
job's world is its JobSet's restart count (plus its in-process attempt, 0 here), which its
pods carry as WORKLOAD_ATTEMPT from their `restart-attempt` label; the supervisor learns
it from the JobSet restarts its watch sees, and refuses what a pod of an older restart
reports, as on the local backend (supervisor/kube/worlds.py, supervisor/sensor/worlds.py).

`supervisor serve` with the Kubernetes backend, a real `host-monitor` per node (started as
a spare), and a small trainer (tests/fixtures/world_worker.py) run for each pod by a
kubelet that starts real processes (tests/kube_real_kubelet.py). The real JobSet
controller restarts the JobSet when a worker crashes; a pod of the old restart whose
trainer is hung (it ignores its pod's SIGTERM, with a long grace period) keeps
reporting. Its reports are refused, its host monitor kills it at once; the new
restart's pods are taken. A JobSet made again (a scale-down) counts from 0 again, and its
pods are taken too.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from supervisor.kube import objects as o
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import jobset
from tests.kube_real import NS, running
from tests.kube_real_fixtures import RealPlaneEnv, env_fixture
from tests.test_host_monitor import AGENT_TOKEN, WORKER_TOKEN
from tests.timing import scaled, wait_until

#: Seconds the hung trainer's pod may take to stop: far past what the test waits.
HUNG_GRACE_S = 600
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
#: The label of the test's JobSet, which its supervisor selects (and no other test's).
SELECTOR = "worlds-test"


def label_env(name: str, label: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}


class Worlds(RealPlaneEnv):
    """Nodes of the test's own pool, the supervisor, a host monitor per node, the kubelet
    that runs their pods' processes, and a JobSet of two one-pod replicas."""

    # The JobSet is created at once: its pods' trainers report to host monitors up by then.
    wait_for_spares = False

    def __init__(self, plane: ControlPlane, who: Identity, tmp: Path, tag: str) -> None:
        # The hung pod holds its node through the restart: its replacement needs a third.
        super().__init__(plane, who, tmp, tag, job=f"worlds-{tag}", prefix="worlds", count=3)

    def supervisor_env(self) -> dict[str, str]:
        return {
            **super().supervisor_env(),
            "SUPERVISOR_KUBE_JOBSET_SELECTOR": f"{SELECTOR}={self.pool}",
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": "0.2",
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": "30",
            "SUPERVISOR_EMERGENCY_CHECKPOINT_TIMEOUT_S": "2",
            "SUPERVISOR_NUM_DP_REPLICAS": "2",
            "SUPERVISOR_NUM_NODES_PER_DP": "1",
            "SUPERVISOR_MIN_NUM_DP_REPLICAS": "1",
            "SUPERVISOR_POD_TERMINATION_THRESHOLD_S": str(scaled(30)),
        }

    def agent_flags(self, node: str) -> dict[str, Any]:
        return {
            "heartbeat_polling_period_s": 0.2,
            "worker_heartbeat_timeout_s": 10.0,
            "idle_release_s": scaled(2.0),
        }

    def jobset(self) -> dict[str, Any]:
        """The JobSet of "JobSet requirements": each pod's trainer reports as its rank
        (its replica's index) in the world its pod carries, and ignores SIGTERM in world
        0."""
        body = jobset(self.job)
        body["metadata"]["namespace"] = NS
        body["metadata"]["labels"][SELECTOR] = self.pool
        pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        pod["nodeSelector"] = {"pool": self.pool}
        pod["terminationGracePeriodSeconds"] = HUNG_GRACE_S
        (container,) = pod["containers"]
        container["command"] = ["python", "-m", "tests.fixtures.world_worker"]
        container["env"] = [
            label_env("RANK", o.JS + "job-index"),
            # The world: each JobSet restart is a newer one.
            label_env("WORKLOAD_ATTEMPT", o.RESTART_ATTEMPT),
            label_env("HOST_MONITOR_JOB", o.JOBSET_NAME),
            {"name": "HOST_MONITOR_URL", "value": "set by the kubelet"},
            {"name": "HOST_MONITOR_WORKER_TOKEN", "value": WORKER_TOKEN},
            {"name": "WORLD_SIZE", "value": "2"},
            {"name": "HUNG_IN_WORLD", "value": "0"},
        ]
        return body

    # --- what a user looks at -------------------------------------------------------------

    def of_attempt(self, attempt: str, count: int = 2) -> list[dict[str, Any]] | None:
        """The JobSet's `count` running pods of restart attempt `attempt`, else None."""
        found: list[dict[str, Any]] | None = running(self.plane, self.job, count, attempt)
        return found

    def process(self, pod: dict[str, Any]) -> Any:
        return self.bridge.containers[pod["metadata"]["uid"]].proc

    def trains(self, pod: dict[str, Any]) -> bool:
        """The supervisor took a heartbeat of the pod's trainer, running."""
        view = self.supervisor.node(pod["spec"]["nodeName"]) or {}
        pid = self.process(pod).pid
        return view.get("job") == self.job and any(
            w["pid"] == pid and w["state"] == "running" for w in view.get("workers") or []
        )

    def refused(self, report: str) -> float:
        text = self.supervisor.http.get("/metrics").text
        line = f'supervisor_stale_world_reports_total{{outcome="refused",report="{report}"}}'
        (value,) = [row.split()[-1] for row in text.splitlines() if row.startswith(line)]
        return float(value)

    def restarts(self) -> int:
        return int((self.jobset_now().get("status") or {}).get("restarts") or 0)

    def logs(self) -> str:
        """What the pods' trainers and the host monitors wrote, for a failure's message."""
        paths = [*(self.tmp / "pods").glob("*.log"), *(a.log for a in self.agents.values())]
        return "".join(p.read_text(errors="replace")[-2000:] for p in paths)

    def crash(self, pod: dict[str, Any]) -> None:
        """SIGKILL the pod's trainer (an OOM kill, a segfault)."""
        os.kill(self.process(pod).pid, signal.SIGKILL)


worlds = env_fixture(Worlds, "worlds")


def index(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][o.JS + "job-index"])


def test_a_pod_of_an_older_jobset_restart_is_refused_until_the_jobset_is_made_again(
    worlds: Worlds,
) -> None:
    """A trainer crashes; the real JobSet controller restarts the JobSet (restart attempt
    1). The other pod of restart 0, its trainer hung, keeps running through its grace
    period: its host monitor's heartbeats are refused (409 `stale_world`) once the
    supervisor sees the restart, and the host monitor kills it at once. The trainers of
    restart 1 report and are taken; a checkpoint report of restart 0 is not recorded, one
    of restart 1 is. Each refusal is counted. Then the operator scales the job down: the
    JobSet is recreated, its restart count 0 again, and its pod of restart 0 is taken,
    not refused as an older world's: it trains on, and the new JobSet is never
    restarted."""
    first = wait_until(lambda: worlds.of_attempt("0"), "2 pods of restart 0 running", 60)
    wait_until(lambda: all(worlds.trains(p) for p in first), "restart 0 trains", 30)
    assert worlds.refused("heartbeat") == 0
    crashed, hung = sorted(first, key=index)
    old = worlds.process(hung)
    began = time.monotonic()
    worlds.crash(crashed)

    wait_until(lambda: worlds.restarts() == 1, "the JobSet controller restarts the JobSet", 30)
    # Without the fence it would run on for its pod's whole grace period.
    wait_until(lambda: old.poll() is not None, "the hung trainer of restart 0 is stopped", 30)
    stopped_in = time.monotonic() - began
    assert stopped_in < HUNG_GRACE_S / 4, stopped_in
    assert old.returncode == -signal.SIGKILL, old.returncode
    assert worlds.refused("heartbeat") >= 1

    second = wait_until(lambda: worlds.of_attempt("1"), "2 pods of restart 1 running", 60)
    wait_until(lambda: all(worlds.trains(p) for p in second), "restart 1 trains", 30)

    # Checkpoint reports, as the host monitor of each node forwards them: of the world
    # of the pod it ran before the restart, and of the one it runs now.
    def world(pod: dict[str, Any]) -> int:
        return int(pod["metadata"]["labels"][o.RESTART_ATTEMPT])

    now = datetime.now(UTC).isoformat()
    base = {"job": worlds.job, "rank": 1, "step": 7, "duration_s": 0.1, "time": now}
    base.update(event="saved", tier="ram")
    new = next(p for p in second if index(p) == "1")
    reports = [
        {**base, "id": f"{worlds.job}-old", "node": hung["spec"]["nodeName"], "world": world(hung)},
        {**base, "id": f"{worlds.job}-new", "node": new["spec"]["nodeName"], "world": world(new)},
    ]
    with httpx.Client(base_url=worlds.supervisor.url, headers=AGENT, timeout=10) as http:
        r = http.post("/api/v1/checkpoints", json={"reports": reports})
    assert r.status_code == 200, r.text
    assert r.json() == {"stored": 1, "duplicates": 0, "refused": 1}
    assert worlds.refused("checkpoint") == 1
    stored = {c["id"] for c in worlds.supervisor.http.get("/api/v1/checkpoints").json()}
    assert f"{worlds.job}-new" in stored and f"{worlds.job}-old" not in stored

    uid = worlds.jobset_now()["metadata"]["uid"]
    r = worlds.supervisor.http.post(
        "/api/v1/actions",
        json={"type": "scale_down", "job": worlds.job, "params": {"to_replicas": 1}},
    )
    assert r.status_code == 202, r.text

    def recreated() -> list[dict[str, Any]] | None:
        if worlds.jobset_now().get("metadata", {}).get("uid") in (None, uid):
            return None
        return worlds.of_attempt("0", count=1)

    (pod,) = wait_until(recreated, "the JobSet recreated, its pod running", 60)
    wait_until(lambda: worlds.trains(pod), "the new JobSet's pod trains", 30)
    proc, node = worlds.process(pod), pod["spec"]["nodeName"]

    def step() -> int:
        view = worlds.supervisor.node(node) or {}
        return max([w["step"] or 0 for w in view.get("workers") or []], default=0)

    start = step()
    wait_until(lambda: step() >= start + 10, "its steps advance", 30)
    assert proc.poll() is None, worlds.logs()
    assert worlds.restarts() == 0
