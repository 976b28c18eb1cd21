"""The production mode end to end on the real Kubernetes control plane (tests/control_plane.py):
the scenarios once run on the model (tests/kube_model_e2e.py), with the real API server,
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

import contextlib
import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.kube import objects as o
from tests.control_plane import ControlPlane, Identity
from tests.kube_model_e2e import (
    EMERGENCY_SAVED,
    FAILURES,
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_TIMEOUT_S,
    RESUMED,
    jobset,
)
from tests.kube_real import JOBSETS, NS, get
from tests.kube_real_kubelet import RealKubelet
from tests.test_host_monitor import ACTUATOR_TOKEN, WORKER_TOKEN, Agent, Cluster, Supervisor
from tests.timing import scaled

SUPERVISED = "resiliency.supervisor.io/supervised"
RELEASE = "e2e"
SECRET = f"{RELEASE}-resiliency-supervisor-worker-token"
POLL_S = 0.25
_tags = itertools.count()


def wait_for(predicate: Callable[[], Any], within: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + scaled(within)
    while True:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what or predicate}")
        time.sleep(POLL_S)


class RealE2E:
    """Six GPU nodes of the test's own pool, the supervisor, a host monitor per node, the
    kubelet that runs their pods' processes."""

    def __init__(self, plane: ControlPlane, who: Identity, tmp: Path, tag: str) -> None:
        self.plane, self.who, self.tmp = plane, who, tmp
        self.job = f"pretrain-{tag}"
        self.pool = f"e2e-{tag}"
        self.nodes = [f"{tag}-gpu-{i}" for i in range(6)]
        self.supervisor = Supervisor(tmp)
        self.cluster = Cluster(tmp)
        self.agents: dict[str, Agent] = {}
        self.bridge = RealKubelet(plane, tmp / "pods")

    def supervisor_env(self) -> dict[str, str]:
        return {
            "SUPERVISOR_BACKEND": "kubernetes",
            "SUPERVISOR_KUBE_CONFIG": str(self.who.kubeconfig),
            "SUPERVISOR_KUBE_NAMESPACE": NS,
            "SUPERVISOR_KUBE_GPU_NODE_SELECTOR": f"pool={self.pool}",
            "SUPERVISOR_KUBE_JOBSET_SELECTOR": f"{SUPERVISED}=true",
            "SUPERVISOR_HOST_MONITOR_ACTUATOR_TOKEN": ACTUATOR_TOKEN,
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": str(HEARTBEAT_PERIOD_S),
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
            "SUPERVISOR_EMERGENCY_CHECKPOINT_TIMEOUT_S": "5",
            "SUPERVISOR_ACTION_TIMEOUT_S": "30",
            "SUPERVISOR_ACTION_RETRY_BACKOFF_S": "0.2",
            # Pods of a dead node stay terminating (its kubelet is gone): force-delete
            # them soon; a pod ended by a live kubelet goes within it.
            "SUPERVISOR_POD_TERMINATION_THRESHOLD_S": str(scaled(5)),
            # A node that dies here is really down (`node_dies` SIGKILLs all it runs).
            "SUPERVISOR_KUBE_PLATFORM_FENCES_NODES": "true",
            "SUPERVISOR_JOBSET_DOWNTIME_THRESHOLD_S": "120",
            "SUPERVISOR_NODE_RECOVERY_HEALTHY_S": "3600",
            "SUPERVISOR_NUM_DP_REPLICAS": "2",
            "SUPERVISOR_NUM_NODES_PER_DP": "2",
            "SUPERVISOR_MIN_NUM_DP_REPLICAS": "1",
            "SUPERVISOR_MAX_NUM_DP_REPLICAS": "2",
        }

    def jobset(self) -> dict[str, Any]:
        """The chart's example as a user applies it: RELEASE replaced, its shared claim a
        directory of the test (no volume here), on the test's pool."""
        body = jobset(self.tmp)
        body["metadata"]["name"] = self.job
        body["metadata"]["namespace"] = NS
        pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        pod["nodeSelector"] = {"pool": self.pool}
        for volume in pod["volumes"]:
            if volume["name"] == "shared":
                volume.pop("persistentVolumeClaim")
                volume["hostPath"] = {"path": str(self.tmp / "shared"), "type": "DirectoryOrCreate"}
        for var in pod["containers"][0]["env"]:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                ref["name"] = ref["name"].replace("RELEASE", RELEASE)
        return body

    def start(self) -> None:
        self.plane.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": SECRET, "namespace": NS},
                "stringData": {"token": WORKER_TOKEN},
            }
        )
        self.supervisor.env.update(self.supervisor_env())

        def start_agent(name: str) -> Agent:
            return self.cluster.start_agent(
                self.supervisor.url,
                node=name,
                heartbeat_polling_period_s=HEARTBEAT_PERIOD_S,
                worker_heartbeat_timeout_s=5.0,
                idle_release_s=scaled(2.0),
            )

        # The supervisor and the host monitors start side by side (a host monitor waits
        # for the supervisor to answer): each is seconds of imports on a loaded machine.
        with ThreadPoolExecutor(len(self.nodes) + 1) as pool:
            supervisor = pool.submit(self.supervisor.start)
            for name, agent in zip(self.nodes, pool.map(start_agent, self.nodes), strict=True):
                self.agents[name] = agent
                self.bridge.add_node(name, agent.url, {"gpu": "true", "pool": self.pool})
            supervisor.result()
        self.bridge.start()
        wait_for(
            lambda: all((self.node(n) or {}).get("state") == "spare" for n in self.nodes),
            30,
            f"{len(self.nodes)} spares",
        )
        self.plane.apply(self.jobset())

    def stop(self) -> None:
        # The supervisor first: the rest going away is not a failure for it to remedy.
        self.supervisor.stop()
        self.bridge.stop()
        for agent in self.agents.values():  # all at once: each takes its shutdown grace
            with contextlib.suppress(ProcessLookupError):
                agent.proc.send_signal(signal.SIGTERM)
        self.cluster.teardown()
        with self.plane.client() as api:
            api.delete(f"{JOBSETS}/{self.job}", params={"propagationPolicy": "Background"})
            for name in self.nodes:  # their pods go with them (the pod garbage collector)
                api.delete(f"/api/v1/nodes/{name}")
        assert not self.bridge.errors, self.bridge.errors

    # --- what a user looks at -------------------------------------------------------------

    def api(self, path: str, **params: Any) -> Any:
        r = self.supervisor.http.get(path, params=params)
        assert r.status_code == 200, r.text
        return r.json()

    def node(self, name: str) -> dict[str, Any] | None:
        return self.supervisor.node(name)

    def step(self) -> int:
        step = self.api(f"/api/v1/jobs/{self.job}")["last_step"]
        return -1 if step is None else int(step)

    def actions(self, type_: str | None = None) -> list[dict[str, Any]]:
        params = {"type": type_} if type_ else {}
        return list(self.api("/api/v1/actions", limit=200, **params)["items"][::-1])

    def events(self, type_: str | None = None) -> list[dict[str, Any]]:
        params = {"type": type_} if type_ else {}
        return list(self.api("/api/v1/events", limit=200, **params)["items"][::-1])

    def settled(self) -> list[dict[str, Any]]:
        items = self.actions()
        return items if all(a["status"] in ("succeeded", "failed") for a in items) else []

    def get(self, path: str) -> dict[str, Any]:
        found = get(self.plane, path)
        assert found is not None, path
        return found

    def pods(self) -> list[dict[str, Any]]:
        found = self.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={o.JOBSET_NAME}%3D{self.job}")
        return [
            p
            for p in found["items"]
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]

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

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in (self.tmp / "pods").glob("*.log"))

    def kube_events(self, name: str) -> dict[str, dict[str, Any]]:
        found = self.get(
            f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name%3D{name}"
        )
        return {e["reason"]: e for e in found["items"]}

    def jobset_status(self) -> dict[str, Any]:
        return dict(self.get(f"{JOBSETS}/{self.job}").get("status") or {})

    def crash_worker(self, node: str) -> None:
        """SIGKILL the training process of `node`'s pod (OOM kill, segfault)."""
        (container,) = self.bridge.running(node)
        os.kill(container.proc.pid, signal.SIGKILL)

    def node_dies(self, node: str) -> None:
        """The machine goes: its host monitor and workers are SIGKILLed, its kubelet falls
        silent (Ready Unknown, as the node lifecycle controller writes it)."""
        agent = self.agents[node]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(5)
        self.bridge.node_down(node)


@pytest.fixture
def e2e(
    control_plane: ControlPlane, kube_supervisor: Identity, tmp_path: Path
) -> Iterator[RealE2E]:
    env = RealE2E(control_plane, kube_supervisor, tmp_path, f"e{next(_tags)}")
    try:
        env.start()
        yield env
    finally:
        env.stop()


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
