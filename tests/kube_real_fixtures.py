"""The set-up the end-to-end tests on the real control plane share (tests/control_plane.py):
nodes of the test's own pool, `supervisor serve` with the Kubernetes backend holding the
chart's ServiceAccount token, a real `host-monitor` per node (started as a spare), and
the kubelet that runs the pods' processes on those nodes (tests/kube_real_kubelet.py).

A test module subclasses `RealPlaneEnv` for its JobSet, its supervisor's settings and
its host monitors' flags, and runs it with `started`: each test's nodes, pool and JobSet
carry a tag of their own, so that the tests share the session's control plane. What a
user looks at (the supervisor's API, the API server's objects as the admin reads them)
and the faults (a worker crashing, a node dying) are methods of the environment.
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
from typing import Any, TypeVar

import httpx
import pytest

from supervisor.kube import objects as o
from tests.control_plane import ControlPlane, Identity
from tests.kube_real import JOBSETS, NS, get
from tests.kube_real_kubelet import RealKubelet
from tests.test_host_monitor import ACTUATOR_TOKEN, WORKER_TOKEN, Agent, Cluster, Supervisor
from tests.timing import scaled

REPO = Path(__file__).resolve().parents[1]
#: The chart's release the example JobSets name (their worker token's Secret).
RELEASE = "e2e"
SECRET = f"{RELEASE}-resiliency-supervisor-worker-token"
HEARTBEAT_PERIOD_S = 0.3
HEARTBEAT_TIMEOUT_S = 1.5
#: How long a rank may make no progress before its host monitor calls it lost (the
#: product's default, scaled as a margin): no test on the real plane finds a hang by a
#: rank's silence, and on the suite's loaded 2 cores four ranks' first checkpoint saves
#: stalled one rank's steps for over 5 s, a fault no test injected, healed as one.
WORKER_HEARTBEAT_TIMEOUT_S = scaled(10.0)
#: Each poll is an HTTP request the service answers from its store: four a second is fine
#: enough for every wait here; ten took CPU the jobs need on a 2-core machine.
POLL_S = 0.25
#: How much of each pod's log, and how many lines of each host monitor's and the
#: supervisor's (those with one of STORY_WORDS), a failed test's report carries: the
#: end, where a process says why it ended.
STORY_POD_LOG_CHARS = 1500
STORY_LOG_LINES = 15
STORY_WORDS = (" WARNING ", " ERROR ", "exit", "stopped")
#: A tag per environment of the session: its nodes', pool's and JobSet's names.
tags = itertools.count()
E = TypeVar("E", bound="RealPlaneEnv")


def wait_for(predicate: Callable[[], Any], within: float = 30.0, what: str = "") -> Any:
    """The predicate's first true value, polled; an HTTP error counts as not yet."""
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


def healing_env(nodes_per_dp: int, action_timeout_s: float) -> dict[str, str]:
    """The settings of a supervisor healing a job of two replicas of `nodes_per_dp` nodes
    (scaled between 1 and 2) here: heartbeats a few tenths of a second apart, pods of a
    dead node force-deleted soon (its kubelet is gone), and the platform said to fence
    its nodes (a node that dies here is really down: `node_dies` SIGKILLs all it runs)."""
    return {
        "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": str(HEARTBEAT_PERIOD_S),
        "SUPERVISOR_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        "SUPERVISOR_EMERGENCY_CHECKPOINT_TIMEOUT_S": "5",
        "SUPERVISOR_ACTION_TIMEOUT_S": str(action_timeout_s),
        "SUPERVISOR_ACTION_RETRY_BACKOFF_S": "0.2",
        # A pod ended by a live kubelet goes within this.
        "SUPERVISOR_POD_TERMINATION_THRESHOLD_S": str(scaled(5)),
        "SUPERVISOR_KUBE_PLATFORM_FENCES_NODES": "true",
        "SUPERVISOR_JOBSET_DOWNTIME_THRESHOLD_S": "120",
        "SUPERVISOR_NODE_RECOVERY_HEALTHY_S": "3600",
        "SUPERVISOR_NUM_DP_REPLICAS": "2",
        "SUPERVISOR_NUM_NODES_PER_DP": str(nodes_per_dp),
        "SUPERVISOR_MIN_NUM_DP_REPLICAS": "1",
        "SUPERVISOR_MAX_NUM_DP_REPLICAS": "2",
    }


def as_applied(body: dict[str, Any], name: str, pool: str, tmp: Path) -> dict[str, Any]:
    """One of the chart's example JobSets as a user applies it: named `name`, RELEASE
    replaced, its shared claim a directory of the test (no volume here), on `pool`."""
    body["metadata"]["name"] = name
    body["metadata"]["namespace"] = NS
    pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"pool": pool}
    for volume in pod["volumes"]:
        if volume["name"] == "shared":
            volume.pop("persistentVolumeClaim")
            volume["hostPath"] = {"path": str(tmp / "shared"), "type": "DirectoryOrCreate"}
    for var in pod["containers"][0]["env"]:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            ref["name"] = ref["name"].replace("RELEASE", RELEASE)
    return body


class RealPlaneEnv:
    """`count` GPU nodes of the pool `<prefix>-<tag>` (named `<tag>-gpu-<i>`), the
    supervisor, a host monitor per node and the kubelet running their pods' processes,
    then the subclass's JobSet (named `job`). `wait_for_spares`: the JobSet is created
    once every node is a spare, as a user starts a job on a fleet already watched."""

    wait_for_spares = True

    def __init__(
        self, plane: ControlPlane, who: Identity, tmp: Path, tag: str, *, job: str, prefix: str,
        count: int,
    ) -> None:  # fmt: skip
        self.plane, self.who, self.tmp = plane, who, tmp
        self.job = job
        self.pool = f"{prefix}-{tag}"
        self.nodes = [f"{tag}-gpu-{i}" for i in range(count)]
        self.supervisor = Supervisor(tmp)
        self.cluster = Cluster(tmp)
        self.agents: dict[str, Agent] = {}
        self.bridge = RealKubelet(plane, tmp / "pods")

    # --- what subclasses choose ------------------------------------------------------------

    def supervisor_env(self) -> dict[str, str]:
        """The Kubernetes backend as the chart's ServiceAccount, seeing the test's pool as
        its GPU nodes."""
        return {
            "SUPERVISOR_BACKEND": "kubernetes",
            "SUPERVISOR_KUBE_CONFIG": str(self.who.kubeconfig),
            "SUPERVISOR_KUBE_NAMESPACE": NS,
            "SUPERVISOR_KUBE_GPU_NODE_SELECTOR": f"pool={self.pool}",
            "SUPERVISOR_HOST_MONITOR_ACTUATOR_TOKEN": ACTUATOR_TOKEN,
        }

    def agent_flags(self, node: str) -> dict[str, Any]:
        return {}

    def jobset(self) -> dict[str, Any]:
        raise NotImplementedError

    # --- start and stop --------------------------------------------------------------------

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
                self.supervisor.url, node=name, **self.agent_flags(name)
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
        if self.wait_for_spares:
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
        r = self.supervisor.http.get(f"/api/v1/jobs/{self.job}")
        step = r.json()["last_step"] if r.status_code == 200 else None
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
        return items if all(a["status"] in ("succeeded", "failed") for a in items) else []

    def get(self, path: str) -> dict[str, Any]:
        found = get(self.plane, path)
        assert found is not None, path
        return found

    def all_pods(self) -> list[dict[str, Any]]:
        """Every pod of the JobSet the API server has, terminating and ended ones too."""
        found = self.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={o.JOBSET_NAME}%3D{self.job}")
        return list(found["items"])

    def pods(self) -> list[dict[str, Any]]:
        """The JobSet's running pods, none being deleted."""
        return [
            p
            for p in self.all_pods()
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]

    def pod(self, name: str) -> dict[str, Any] | None:
        return get(self.plane, f"/api/v1/namespaces/{NS}/pods/{name}")

    def jobset_now(self) -> dict[str, Any]:
        return get(self.plane, f"{JOBSETS}/{self.job}") or {}

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in (self.tmp / "pods").glob("*.log"))

    def kube_events(self, name: str) -> dict[str, dict[str, Any]]:
        found = self.get(
            f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name%3D{name}"
        )
        return {e["reason"]: e for e in found["items"]}

    def story(self) -> str:
        """What the supervisor saw and did, and what the API server recorded of the JobSet's
        objects, oldest first: added to a failed test's report, since a fault the test did
        not inject (a heartbeat lost on a busy machine) shows only there."""
        lines = ["the supervisor's events:"]
        lines += [
            f"  {e['time']} {e['type']} node={e['node']} rank={e['rank']} {e['details']}"
            for e in self.events()
        ]
        lines.append("its actions:")
        lines += [
            f"  {a['created_at']} {a['type']} {a['status']} node={a['node']} "
            f"reason={a['reason']!r} error={a['error']!r}"
            for a in self.actions()
        ]
        found = self.get(f"/api/v1/namespaces/{NS}/events")
        lines.append("the API server's events of the JobSet, its Jobs and pods, and the nodes:")
        kept = [
            (e.get("lastTimestamp") or e.get("eventTime") or "", e)
            for e in found["items"]
            if (about := e["involvedObject"])["kind"] in ("JobSet", "Job", "Pod", "Node")
            and (self.job in about["name"] or about["name"] in self.nodes)
        ]
        lines += [
            f"  {at} {e['involvedObject']['kind']}/{e['involvedObject']['name']} "
            f"{e['reason']}: {e.get('message', '')}"
            for at, e in sorted(kept, key=lambda pair: pair[0])
        ]
        # Why a process ended shows only in its own output, which is gone with the run.
        for log in sorted((self.tmp / "pods").glob("*.log")):
            tail = log.read_text(errors="replace")[-STORY_POD_LOG_CHARS:]
            lines.append(f"the end of pod {log.stem}'s log:")
            lines += [f"  {line}" for line in tail.splitlines()]
        logs = [(f"host monitor of {n}", a.log) for n, a in sorted(self.agents.items())]
        for who, path in [*logs, ("supervisor", self.supervisor.log)]:
            said = path.read_text(errors="replace").splitlines() if path.exists() else []
            told = [line for line in said if any(word in line for word in STORY_WORDS)]
            lines.append(f"the {who}: its last warnings, errors and workers' ends:")
            lines += [f"  {line}" for line in told[-STORY_LOG_LINES:]]
        return "\n".join(lines)

    # --- faults ---------------------------------------------------------------------------

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


@contextlib.contextmanager
def started(env: E) -> Iterator[E]:
    """The environment started, then stopped whatever the test did."""
    try:
        env.start()
        yield env
    except BaseException as failure:
        try:
            failure.add_note(env.story())
        except Exception as unread:  # the failure matters, not its story
            failure.add_note(f"(the environment's story could not be read: {unread!r})")
        raise
    finally:
        env.stop()


def env_fixture(make: Callable[[ControlPlane, Identity, Path, str], E], name: str) -> Any:
    """A fixture `name` giving each test an environment of its own (`make(plane,
    identity, tmp_path, tag)`), started and then stopped, on the session's control plane
    as the chart's ServiceAccount."""

    def fixture(
        control_plane: ControlPlane, kube_supervisor: Identity, tmp_path: Path
    ) -> Iterator[E]:
        tag = f"{name[0]}{next(tags)}"
        with started(make(control_plane, kube_supervisor, tmp_path, tag)) as env:
            yield env

    return pytest.fixture(name=name)(fixture)
