"""The production mode end to end on the real Kubernetes control plane (tests/control_plane.py):
the scenarios once run on the model of the API server, with the real API server,
scheduler, Job and JobSet controllers (the JobSet's failure policy deciding its own
restarts) and node lifecycle controller in place of FakeKube's models; more of them in
tests/test_kube_e2e_real_restarts.py.

`supervisor serve` with the Kubernetes backend (the chart's ServiceAccount token, the
default policy, SQLite), a real `host-monitor` per node (started as a spare), and the
demo training workload of the chart's example JobSet run for each pod by a kubelet that
starts real processes (tests/kube_real_kubelet.py: it registers the nodes and keeps them
Ready). Faults are real: SIGKILL of a node's processes with its kubelet gone silent, a
worker process crashing.

Each test has nodes (`<tag>-gpu-<i>`, labelled `pool=<tag>`) and a JobSet of its own
name, so that they share the session's control plane.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import yaml

from supervisor.kube import objects as o
from tests.control_plane import ControlPlane, Identity
from tests.kube_real import JOBSETS
from tests.kube_real_fixtures import (
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_TIMEOUT_S,
    REPO,
    WORKER_HEARTBEAT_TIMEOUT_S,
    RealPlaneEnv,
    as_applied,
    env_fixture,
    healing_env,
    wait_for,
)
from tests.timing import scaled

SUPERVISED = "resiliency.supervisor.io/supervised"
EXAMPLE = REPO / "helm" / "resiliency-supervisor" / "examples" / "jobset.yaml"
RESUMED = re.compile(r"resumed step=(\d+) tier=(\w+)")
EMERGENCY_SAVED = re.compile(r"emergency checkpoint saved step=(\d+)")
FAILURES = ("worker_exited", "worker_heartbeat_lost", "host_heartbeat_lost", "hang")


def jobset(tmp: Path) -> dict[str, Any]:
    """The chart's example JobSet (2 replicas x 2 nodes, the failure policy of "JobSet
    requirements"), with host paths for its volumes (no container filesystem here: the
    shared volume is a directory of the test, the local tier one directory per node) and
    short steps."""
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    overrides = {
        "STEP_TIME_S": "0.1",
        "RUN_DIR": str(tmp / "shared" / "run"),
        "DURABLE_CKPT_DIR": str(tmp / "shared" / "durable"),
        "OUTPUT_DIR": str(tmp / "shared" / "output"),
        # A hostPath per node: the local tier survives a pod, not the node.
        "LOCAL_CKPT_DIR": str(tmp / "nodes" / "$(NODE_NAME)" / "local"),
        "LOG_EVERY_STEPS": "5",
    }
    for var in container["env"]:
        if var["name"] in overrides:
            var["value"] = overrides.pop(var["name"])
    container["env"] += [{"name": k, "value": v} for k, v in overrides.items()]
    return body


class RealE2E(RealPlaneEnv):
    """Six GPU nodes of the test's own pool, the supervisor, a host monitor per node, the
    kubelet that runs their pods' processes, and the chart's example JobSet."""

    def __init__(self, plane: ControlPlane, who: Identity, tmp: Path, tag: str) -> None:
        super().__init__(plane, who, tmp, tag, job=f"pretrain-{tag}", prefix="e2e", count=6)

    def supervisor_env(self) -> dict[str, str]:
        return {
            **super().supervisor_env(),
            "SUPERVISOR_KUBE_JOBSET_SELECTOR": f"{SUPERVISED}=true",
            **healing_env(nodes_per_dp=2, action_timeout_s=30),
        }

    def agent_flags(self, node: str) -> dict[str, Any]:
        return {
            "heartbeat_polling_period_s": HEARTBEAT_PERIOD_S,
            "worker_heartbeat_timeout_s": WORKER_HEARTBEAT_TIMEOUT_S,
            "idle_release_s": scaled(2.0),
        }

    def jobset(self) -> dict[str, Any]:
        return as_applied(jobset(self.tmp), self.job, self.pool, self.tmp)

    # --- what a user looks at -------------------------------------------------------------

    def placement(self) -> dict[str, str]:
        """The restart attempt of the pod running on each node."""
        return {
            p["spec"]["nodeName"]: p["metadata"]["labels"][o.RESTART_ATTEMPT] for p in self.pods()
        }

    def training_on(self, nodes: set[str], attempt: str | None = None) -> bool:
        placed = self.placement()
        if set(placed) != nodes or (attempt is not None and set(placed.values()) != {attempt}):
            return False
        views = {n: self.node(n) or {} for n in nodes}
        return all(
            v.get("state") == "running"
            and v.get("job") == self.job
            and [w["state"] for w in v.get("workers") or []] == ["running"]
            for v in views.values()
        )

    def jobset_status(self) -> dict[str, Any]:
        return dict(self.get(f"{JOBSETS}/{self.job}").get("status") or {})


e2e = env_fixture(RealE2E, "e2e")


def trains(
    e2e: RealE2E,
    nodes: set[str] | None,
    attempt: str | None = None,
    steps: int = 10,
    avoid: frozenset[str] = frozenset(),
) -> int:
    """Wait until the job's four workers run (on `nodes`, or on any nodes but `avoid`: the
    real scheduler picks them) and its step, as the supervisor sees it, has moved by
    `steps`; returns the step then."""

    def placed() -> bool:
        on = set(e2e.placement())
        if len(on) != 4 or on & avoid or (nodes is not None and on != nodes):
            return False
        return e2e.training_on(on, attempt)

    wait_for(placed, 60, f"workers running on {sorted(nodes or [])} (avoiding {sorted(avoid)})")
    start = wait_for(lambda: e2e.step() >= 0 and e2e.step() + 1, 30, "a step") - 1
    return int(wait_for(lambda: e2e.step() >= start + steps and e2e.step(), 30, "steps advance"))


def test_the_job_trains_on_kubernetes(e2e: RealE2E) -> None:
    """Four pods land on four of the six nodes (the real scheduler's choice); their workers
    register with the host monitors there, the other two stay spares, and the supervisor
    sees the steps advance. Nothing failed, so nothing was done."""
    trains(e2e, None, attempt="0", steps=15)
    placed = set(e2e.placement())
    for spare in set(e2e.nodes) - placed:
        assert (e2e.node(spare) or {}).get("state") == "spare"
    job = e2e.api(f"/api/v1/jobs/{e2e.job}")
    assert sorted(job["nodes"]) == sorted(placed)
    assert (job["num_dp_replicas"], job["num_nodes_per_dp"]) == (2, 2)
    ranks = {int(w["rank"]) for n in placed for w in (e2e.node(n) or {}).get("workers") or []}
    assert ranks == {0, 1, 2, 3}
    assert e2e.actions() == []
    assert [e for e in e2e.events() if e["type"] in FAILURES] == []
    assert e2e.jobset_status().get("restarts", 0) == 0


def test_a_dead_node_is_swapped_for_a_spare_once_and_training_resumes(e2e: RealE2E) -> None:
    """A training node dies (host monitor and worker SIGKILLed, its kubelet silent). The
    supervisor hears the silence and the NotReady, saves the healthy workers' state, and
    hot-swaps the node once: cordoned and tainted, its pod evicted, then force-deleted
    (its kubelet is gone); the real JobSet controller restarts the JobSet by its failure
    policy, off the dead node, and the workers resume from the emergency step."""
    trains(e2e, None, attempt="0", steps=25)
    first = set(e2e.placement())
    dead = sorted(first)[1]
    e2e.node_dies(dead)

    lost = wait_for(
        lambda: [e for e in e2e.events("host_heartbeat_lost") if e["node"] == dead],
        20,
        "host_heartbeat_lost",
    )
    not_ready = wait_for(
        lambda: [e for e in e2e.events("node_not_ready") if e["node"] == dead],
        20,
        "node_not_ready",
    )
    first_signal = min([*lost, *not_ready], key=lambda e: int(e["id"]))
    assert first_signal["job"] == e2e.job, (lost, not_ready)

    final = trains(e2e, None, attempt="1", steps=5, avoid=frozenset({dead}))

    checkpoint = wait_for(
        lambda: [a for a in e2e.actions("emergency_checkpoint") if a["status"] == "succeeded"],
        10,
        "emergency checkpoint",
    )
    (saved,) = checkpoint[0]["result"]["steps"]
    assert checkpoint[0]["params"]["exclude_nodes"] == [dead]
    assert sorted(checkpoint[0]["result"]["nodes"]) == sorted(first - {dead})
    resumed = [(int(s), tier) for s, tier in RESUMED.findall(e2e.logs())]
    assert len(resumed) == 4 and {s for s, _ in resumed} == {saved}, resumed
    assert {int(s) for s in EMERGENCY_SAVED.findall(e2e.logs())} == {saved}
    assert final > saved

    actions = wait_for(e2e.settled, 20, "actions settled")
    swaps = [a for a in actions if a["type"] == "hot_swap"]
    assert len(swaps) == 1, actions
    (swap,) = swaps
    assert swap["status"] == "succeeded" and swap["node"] == dead, swap
    assert swap["params"]["spare"] in set(e2e.nodes) - first
    assert sorted(a["type"] for a in actions) == [
        "emergency_checkpoint",
        "force_delete_pod",
        "hot_swap",
    ], actions
    assert all(a["status"] == "succeeded" for a in actions), actions

    node = e2e.get(f"/api/v1/nodes/{dead}")
    assert node["spec"].get("unschedulable") is True
    assert any(
        t["key"] == "resiliency.supervisor.io/unhealthy" and t["effect"] == "NoExecute"
        for t in node["spec"].get("taints") or []
    )
    on_node = e2e.kube_events(dead)
    assert (
        "HotSwap" in on_node and f"supervisor action {swap['id']}" in on_node["HotSwap"]["message"]
    )
    on_jobset = e2e.kube_events(e2e.job)
    assert {"EmergencyCheckpoint", "HotSwap", "ForceDeletePod"} <= set(on_jobset), sorted(on_jobset)
    status = e2e.jobset_status()
    assert status["restarts"] == 1, status
    # The restart for the eviction did not count toward the JobSet's maxRestarts.
    assert status.get("restartsCountTowardsMax", 0) == 0, status


def test_a_crash_restarts_the_jobset_once(e2e: RealE2E) -> None:
    """A worker process is SIGKILLed: the kubelet reports its exit (137), its Job fails
    (backoffLimit 0) and the real JobSet controller restarts the JobSet by its own failure
    policy. The supervisor hears the exit too; its remedy must not restart the JobSet a
    second time."""
    trains(e2e, None, attempt="0", steps=10)
    victim = sorted(e2e.placement())[2]
    e2e.crash_worker(victim)
    exited = wait_for(
        lambda: [e for e in e2e.events("worker_exited") if e["node"] == victim],
        20,
        "worker_exited",
    )
    # The host monitor adopted the worker (it did not launch it): its exit code is
    # unknown there, only that it died without saying it was stopping.
    assert exited[0]["details"].get("exit_code") is None, exited[0]
    trains(e2e, None, attempt="1", steps=10)
    actions = wait_for(e2e.settled, 30, "actions settled")
    status = e2e.jobset_status()
    assert sorted(a["type"] for a in actions) == ["emergency_checkpoint", "restart_in_place"]
    (restart,) = [a for a in actions if a["type"] == "restart_in_place"]
    assert restart["status"] == "succeeded", restart
    skipped = (restart["result"] or {}).get("skipped", "")
    if skipped:
        # The usual order: the kubelet reported the container's end, its Job failed, and
        # the JobSet controller restarted the JobSet by its own policy, counted toward
        # maxRestarts; the supervisor's restart found that done.
        assert "already restarted" in skipped, restart
        assert (status["restarts"], status.get("restartsCountTowardsMax")) == (1, 1), status
    else:
        # Seen once under load: the supervisor heard the worker's exit before the kubelet
        # reported it, found the pod still Running, and restarted it (its eviction marks
        # the pod DisruptionTarget): the JobSet restarted once all the same, by the rule
        # for the supervisor's restarts, which uses up no maxRestarts.
        assert status["restarts"] == 1 and not status.get("restartsCountTowardsMax"), status
    # The three workers whose pods the JobSet controller deleted were stopped, not crashed.
    assert len(e2e.events("worker_exited")) == 1
    # A late second restart would show here.
    time.sleep(2 * HEARTBEAT_TIMEOUT_S)
    assert e2e.jobset_status()["restarts"] == 1
    assert set(e2e.placement().values()) == {"1"} and len(e2e.placement()) == 4
