"""The production mode end to end on the model of the API server (tests/kube's FakeKube):
the harness of the modules that still run pods' processes through the kubelet bridge
(tests/test_kube_in_process.py, tests/test_partitions_kube.py), and what the real plane's
end-to-end modules share with it (the chart's example JobSet with host paths, the log
patterns, the heartbeat timings). Every end-to-end scenario of a trained job, a dead
node, a crash, workers crashing together, a node forgetting a replaced pod's workers and
a workload restart runs on the real control plane (tests/test_kube_e2e_real*.py).

`supervisor serve` with the Kubernetes backend (a kubeconfig pointing at the fake API
server, the default policy, SQLite), a real `host-monitor` per node (started as a spare,
heartbeating the supervisor), and each pod's container command run by the kubelet
bridge (tests/kube/kubelet_bridge.py). Still a fake where there is no choice: the API
server, scheduler, Job and JobSet controllers are FakeKube's models, and containers are
plain processes (see the bridge).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.failover import write_kubeconfig
from tests.kube import FakeKube
from tests.kube.kubelet_bridge import KubeletBridge
from tests.test_host_monitor import (
    ACTUATOR_TOKEN,
    WORKER_TOKEN,
    Agent,
    Cluster,
    Supervisor,
)
from tests.timing import scaled

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "helm" / "resiliency-supervisor" / "examples" / "jobset.yaml"
JOB = "pretrain"
NODES = [f"gpu-{i}" for i in range(6)]
JS = "jobset.sigs.k8s.io/"
KUBE_TOKEN = "e2e-kube-token"
HEARTBEAT_PERIOD_S = 0.3
HEARTBEAT_TIMEOUT_S = 1.5
RESUMED = re.compile(r"resumed step=(\d+) tier=(\w+)")
EMERGENCY_SAVED = re.compile(r"emergency checkpoint saved step=(\d+)")
FAILURES = ("worker_exited", "worker_heartbeat_lost", "host_heartbeat_lost", "hang")


#: Each poll is an HTTP request the service answers from its store: four a second is fine
#: enough for every wait here; ten took CPU the jobs need on a 2-core machine.
POLL_S = 0.25


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


class E2E:
    """FakeKube with six GPU nodes, the supervisor, a host monitor per node, the bridge.
    Subclasses change the nodes, the supervisor's settings, the agents' and the JobSet."""

    nodes = NODES

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.kube = FakeKube(token=KUBE_TOKEN, time_scale=0.05, bookmark_interval=0.1, tick=0.02)
        self.supervisor = Supervisor(tmp)
        self.cluster = Cluster(tmp)
        self.agents: dict[str, Agent] = {}
        self.bridge = KubeletBridge(
            self.kube,
            tmp / "pods",
            secrets={("RELEASE-resiliency-supervisor-worker-token", "token"): WORKER_TOKEN},
        )

    def supervisor_env(self) -> dict[str, str]:
        return {
            "SUPERVISOR_BACKEND": "kubernetes",
            "SUPERVISOR_KUBE_NAMESPACE": "default",
            "SUPERVISOR_KUBE_GPU_NODE_SELECTOR": "gpu=true",
            "SUPERVISOR_HOST_MONITOR_ACTUATOR_TOKEN": ACTUATOR_TOKEN,
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": str(HEARTBEAT_PERIOD_S),
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
            "SUPERVISOR_EMERGENCY_CHECKPOINT_TIMEOUT_S": "5",
            "SUPERVISOR_ACTION_TIMEOUT_S": "30",
            "SUPERVISOR_ACTION_RETRY_BACKOFF_S": "0.2",
            # Pods of a dead node stay terminating (its kubelet is gone): force-delete
            # them soon.
            "SUPERVISOR_POD_TERMINATION_THRESHOLD_S": "2",
            # A node that dies here is really down (`node_dies` SIGKILLs all it runs), as
            # on a platform that fences its nodes: its pods may go with grace 0.
            "SUPERVISOR_KUBE_PLATFORM_FENCES_NODES": "true",
            "SUPERVISOR_JOBSET_DOWNTIME_THRESHOLD_S": "120",
            "SUPERVISOR_NODE_RECOVERY_HEALTHY_S": "3600",
            "SUPERVISOR_NUM_DP_REPLICAS": "2",
            "SUPERVISOR_NUM_NODES_PER_DP": "2",
            "SUPERVISOR_MIN_NUM_DP_REPLICAS": "1",
            "SUPERVISOR_MAX_NUM_DP_REPLICAS": "2",
        }

    def agent_flags(self, node: str) -> dict[str, Any]:
        return {
            "heartbeat_polling_period_s": HEARTBEAT_PERIOD_S,
            "worker_heartbeat_timeout_s": 5.0,
            # How long a stopped worker's state stays to be read (the restart test polls
            # for it): a margin of the test's, scaled with the others.
            "idle_release_s": scaled(2.0),
        }

    def jobset(self) -> dict[str, Any]:
        return jobset(self.tmp)

    def start(self) -> None:
        self.kube.start()
        for name in self.nodes:
            self.kube.add_node(name, gpus=8, labels={"gpu": "true"})
        kubeconfig = write_kubeconfig(self.tmp / "kubeconfig", self.kube.url, KUBE_TOKEN)
        self.supervisor.env.update(
            {**self.supervisor_env(), "SUPERVISOR_KUBE_CONFIG": str(kubeconfig)}
        )
        self.supervisor.start()

        def start_agent(name: str) -> Agent:
            return self.cluster.start_agent(
                self.supervisor.url, node=name, **self.agent_flags(name)
            )

        with ThreadPoolExecutor(len(self.nodes)) as pool:  # each waits for its first line
            for name, agent in zip(self.nodes, pool.map(start_agent, self.nodes), strict=True):
                self.agents[name] = agent
                self.bridge.add_node(name, agent.url)
        self.bridge.start()
        wait_for(
            lambda: all((self.node(n) or {}).get("state") == "spare" for n in self.nodes),
            30,
            f"{len(self.nodes)} spares",
        )
        self.kube.create(self.jobset())

    def stop(self) -> None:
        # The supervisor first: the rest going away is not a failure for it to remedy.
        self.supervisor.stop()
        self.bridge.stop()
        self.cluster.teardown()
        self.kube.stop()
        assert not self.bridge.errors, self.bridge.errors

    # --- what a user looks at -------------------------------------------------------------

    def api(self, path: str, **params: Any) -> Any:
        r = self.supervisor.http.get(path, params=params)
        assert r.status_code == 200, r.text
        return r.json()

    def node(self, name: str) -> dict[str, Any] | None:
        return self.supervisor.node(name)

    def step(self) -> int:
        step = self.api(f"/api/v1/jobs/{JOB}")["last_step"]
        return -1 if step is None else int(step)

    def actions(self, type_: str | None = None) -> list[dict[str, Any]]:
        params = {"type": type_} if type_ else {}
        return list(self.api("/api/v1/actions", limit=200, **params)["items"][::-1])

    def events(self, type_: str | None = None) -> list[dict[str, Any]]:
        params = {"type": type_} if type_ else {}
        return list(self.api("/api/v1/events", limit=200, **params)["items"][::-1])

    def settled(self) -> list[dict[str, Any]]:
        """Every action, once none is still to run."""
        items = self.actions()
        done = all(a["status"] in ("succeeded", "failed") for a in items)
        return items if done else []

    def pods(self) -> list[dict[str, Any]]:
        return [
            p
            for p in self.kube.objects("Pod", "default", label_selector=f"{JS}jobset-name={JOB}")
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]

    def placement(self) -> dict[str, str]:
        """The restart attempt of the pod running on each node."""
        return {
            p["spec"]["nodeName"]: p["metadata"]["labels"][f"{JS}restart-attempt"]
            for p in self.pods()
        }

    def training_on(self, nodes: set[str], attempt: str | None = None) -> bool:
        """The job's workers run on exactly `nodes` (all registered: nodes running it)."""
        placed = self.placement()
        if set(placed) != nodes or (attempt is not None and set(placed.values()) != {attempt}):
            return False
        views = {n: self.node(n) or {} for n in nodes}
        return all(
            v.get("state") == "running"
            and v.get("job") == JOB
            and [w["state"] for w in v.get("workers") or []] == ["running"]
            for v in views.values()
        )

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in (self.tmp / "pods").glob("*.log"))

    def kube_events(self, name: str) -> dict[str, dict[str, Any]]:
        return {
            e["reason"]: e
            for e in self.kube.objects("Event", "default")
            if e["involvedObject"]["name"] == name
        }

    def crash_worker(self, node: str) -> int:
        """SIGKILL the training process of `node`'s pod (OOM kill, segfault)."""
        (container,) = self.bridge.running(node)
        os.kill(container.proc.pid, signal.SIGKILL)
        return container.proc.pid

    def node_dies(self, node: str) -> None:
        """The machine goes: its host monitor and workers are SIGKILLed, its kubelet stops
        posting Ready."""
        agent = self.agents[node]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(5)
        self.bridge.node_down(node)
