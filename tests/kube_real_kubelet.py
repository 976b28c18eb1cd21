"""A kubelet for the real control plane (tests/control_plane.py) that runs real processes:
the nodes of the end-to-end tests on the real plane (tests/kube_real_fixtures.py).

For the nodes it is given (not kwok's: no `type=kwok` label), it plays the kubelet
through the API server, as the admin:

- **The node.** It registers the Node (capacity and labels given, address 127.0.0.1,
  Ready) and keeps it so: its Lease in `kube-node-lease` renewed every `lease_renew_s`
  and its Ready condition's heartbeat every `status_renew_s`, so that the real node
  lifecycle controller does not taint it.
- **Start.** A pod bound to one of its nodes, Pending and not being deleted gets its
  container's command run as a process (tests/kube_real_container.py's
  `container_process`: the env as the kubelet builds it, downward API and Secrets read
  from the API server), then the pod's status written as the kubelet writes it:
  Running, Ready, podIP and hostIP 127.0.0.1, its container running.
- **Exit.** A process that ends by itself is reported by its pod's restartPolicy: Never
  (and OnFailure with exit 0) ends the pod, Succeeded for 0 and Failed otherwise, with
  the container terminated with its code (128 + signal for a signal); Always and
  OnFailure run the command again (restartCount + 1).
- **Stop.** A pod with a deletionTimestamp gets SIGTERM to its process, SIGKILL to its
  process group once deletionGracePeriodSeconds has passed; once the process is gone the
  pod's terminal status is written and the pod removed (delete with grace 0, the uid as
  precondition), as the kubelet's status manager does. A pod gone from the API kills
  its process.
- **A dead node** (`node_down`): nothing more is started, stopped, reported or renewed
  there, its processes get SIGKILL, and its Ready condition turns Unknown as the node
  lifecycle controller writes it once the grace period has passed (at once here).

Level-triggered, like the kubelet's sync loop: every `period` it lists the pods of its
namespace and compares them with the processes it runs, in one thread.
"""

from __future__ import annotations

import base64
import contextlib
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from tests.control_plane import ControlPlane
from tests.kube_real_container import Container, container_process, kill_group, launch

NODE_LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
SMP = {"Content-Type": "application/strategic-merge-patch+json"}
LOOPBACK = "127.0.0.1"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _Node:
    host_monitor_url: str
    alive: bool = True
    lease_at: float = 0.0
    status_at: float = 0.0


@dataclass
class _Run:
    """A container's process and what the kubelet keeps about it."""

    c: Container
    name: str
    image: str
    started_at: str
    restart_policy: str
    restarts: int = 0
    done: bool = False


@dataclass
class RealKubelet:
    plane: ControlPlane
    log_dir: Path
    namespace: str = "default"
    period: float = 0.2
    lease_renew_s: float = 2.0
    status_renew_s: float = 10.0
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="real-kubelet", daemon=True)
        self._api = self.plane.client()
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # --- control --------------------------------------------------------------------------

    def add_node(
        self, name: str, host_monitor_url: str, labels: dict[str, str], gpus: int = 8
    ) -> None:
        """Register the Node `name` (Ready) and run its pods' containers, next to the host
        monitor at that URL."""
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [
                    {"type": "InternalIP", "address": LOOPBACK},
                    {"type": "Hostname", "address": name},
                ],
                "conditions": [self._ready("True")],
            },
        }
        r = self._api.post("/api/v1/nodes", json=body)
        assert r.status_code == 201, r.text
        with self._lock:
            self._nodes[name] = _Node(host_monitor_url)
            self._renew(name, self._nodes[name], time.monotonic())

    def node_down(self, name: str) -> None:
        """The node dies: its kubelet stops, its processes get SIGKILL, its Ready turns
        Unknown (what the node lifecycle controller writes of a silent kubelet)."""
        with self._lock:
            self._nodes[name].alive = False
            for run in self._runs.values():
                if run.c.node == name:
                    kill_group(run.c.proc.pid)
        unknown = self._ready("Unknown")
        unknown.update(reason="NodeStatusUnknown", message="Kubelet stopped posting node status.")
        r = self._api.patch(
            f"/api/v1/nodes/{name}/status",
            json={"status": {"conditions": [unknown]}},
            headers=SMP,
        )
        assert r.status_code == 200, r.text

    def start(self) -> RealKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop syncing and SIGKILL every process started (and reap it)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(30)
        for run in self._runs.values():
            kill_group(run.c.proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.c.proc.wait(5)
        self._api.close()

    def running(self, node: str | None = None) -> list[Container]:
        """Processes alive now (of `node`)."""
        with self._lock:
            return [
                r.c
                for r in self._runs.values()
                if r.c.proc.poll() is None and (node is None or r.c.node == node)
            ]

    @property
    def containers(self) -> dict[str, Container]:
        with self._lock:
            return {uid: r.c for uid, r in self._runs.items()}

    # --- the sync loop --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                with self._lock:
                    self.sync()
            except httpx.TransportError:
                continue  # the API server busy: the next round reads again
            except Exception as exc:  # surfaced by the test, never swallowed
                self.errors.append(exc)
                return

    def sync(self) -> None:
        mono = time.monotonic()
        for name, node in self._nodes.items():
            if node.alive:
                self._renew(name, node, mono)
        r = self._api.get(f"/api/v1/namespaces/{self.namespace}/pods")
        r.raise_for_status()
        pods = {p["metadata"]["uid"]: p for p in r.json()["items"]}
        for uid, run in self._runs.items():
            if not run.done and self._nodes[run.c.node].alive:
                self._sync_run(run, pods.get(uid), mono)
        for uid, pod in pods.items():
            node_name = pod["spec"].get("nodeName") or ""
            target = self._nodes.get(node_name)
            if (
                uid in self._runs
                or target is None
                or not target.alive
                or pod["metadata"].get("deletionTimestamp")
                or pod["status"].get("phase", "Pending") != "Pending"
            ):
                continue
            self._runs[uid] = self._start(pod, node_name, target)

    def _sync_run(self, run: _Run, pod: dict[str, Any] | None, mono: float) -> None:
        c = run.c
        code = c.proc.poll()
        if pod is None:  # removed without us (a forced delete): nothing left to report
            kill_group(c.proc.pid)
            run.done = True
            return
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        terminal = pod["status"].get("phase") in ("Succeeded", "Failed")
        if code is None:
            if terminal:  # ended by someone else (a forced delete marks it Failed first)
                kill_group(c.proc.pid)
            elif deleting and c.term_sent is None:
                c.term_sent = mono
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                c.grace_s = float(grace if grace is not None else c.grace_s)
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
            elif deleting and c.term_sent is not None and mono - c.term_sent >= c.grace_s:
                kill_group(c.proc.pid)
            return
        if c.exit_code is None:
            c.exit_code = code if code >= 0 else 128 - code
        if deleting:
            if not terminal:
                self._terminated(run, pod)
            self._remove(pod)
            run.done = True
        elif not terminal:
            policy = run.restart_policy
            if policy == "Always" or (policy == "OnFailure" and c.exit_code != 0):
                self._restart(run, pod)
            else:
                c.reported = True
                self._terminated(run, pod)
        # A terminal pod not being deleted is kept, as the kubelet keeps it: its owner
        # (the Job controller) deletes it.

    # --- the API writes --------------------------------------------------------------------

    def _ready(self, status: str) -> dict[str, Any]:
        reason = {"True": "KubeletReady", "False": "KubeletNotReady"}.get(status, "")
        stamp = now()
        return {
            "type": "Ready",
            "status": status,
            "reason": reason,
            "message": "kubelet is posting ready status" if status == "True" else "",
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
        }

    def _renew(self, name: str, node: _Node, mono: float) -> None:
        if mono - node.lease_at >= self.lease_renew_s:
            node.lease_at = mono
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name, "namespace": "kube-node-lease"},
                "spec": {
                    "holderIdentity": name,
                    "leaseDurationSeconds": 40,
                    "renewTime": micro_now(),
                },
            }
            r = self._api.patch(
                f"{NODE_LEASES}/{name}",
                params={"fieldManager": "kubelet", "force": "true"},
                json=lease,
                headers={"Content-Type": "application/apply-patch+yaml"},
            )
            r.raise_for_status()
        if mono - node.status_at >= self.status_renew_s:
            node.status_at = mono
            ready = self._ready("True")
            del ready["lastTransitionTime"]  # kept by the server's merge while it stays True
            r = self._api.patch(
                f"/api/v1/nodes/{name}/status",
                json={"status": {"conditions": [ready]}},
                headers=SMP,
            )
            r.raise_for_status()

    def _pod_status(self, pod: dict[str, Any], body: dict[str, Any]) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{pod['metadata']['name']}/status"
        r = self._api.patch(path, json=body, headers=SMP)
        if r.status_code != 404:  # gone meanwhile: nothing left to report on
            r.raise_for_status()

    def _start(self, pod: dict[str, Any], node_name: str, node: _Node) -> _Run:
        m, spec = pod["metadata"], pod["spec"]
        argv, env = container_process(pod, self._secret, node.host_monitor_url)
        log = self.log_dir / f"{m['name']}.log"
        proc = launch(argv, env, log, self.log_dir / m["name"])
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        (container,) = spec["containers"]
        run = _Run(
            Container(m["name"], m["uid"], node_name, proc, log, grace),
            container["name"],
            container.get("image", ""),
            now(),
            spec.get("restartPolicy", "Always"),
        )
        conditions = [
            {"type": t, "status": "True", "lastTransitionTime": run.started_at}
            for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
        ]
        self._pod_status(
            pod,
            {
                "status": {
                    "phase": "Running",
                    "hostIP": LOOPBACK,
                    "hostIPs": [{"ip": LOOPBACK}],
                    "podIP": LOOPBACK,
                    "podIPs": [{"ip": LOOPBACK}],
                    "startTime": run.started_at,
                    "conditions": conditions,
                    "containerStatuses": [self._container(run, {"running": self._since(run)})],
                }
            },
        )
        return run

    def _since(self, run: _Run) -> dict[str, str]:
        return {"startedAt": run.started_at}

    def _container(self, run: _Run, state: dict[str, Any], **extra: Any) -> dict[str, Any]:
        running = "running" in state
        return {
            "name": run.name,
            "image": run.image,
            "imageID": "",
            "containerID": f"bridge://{run.c.proc.pid}",
            "ready": running,
            "started": running,
            "restartCount": run.restarts,
            "state": state,
            **extra,
        }

    def _terminated(self, run: _Run, pod: dict[str, Any]) -> None:
        code = run.c.exit_code or 0
        ended = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": run.started_at,
                "finishedAt": now(),
                "containerID": f"bridge://{run.c.proc.pid}",
            }
        }
        stamp = now()
        not_ready = [
            {"type": t, "status": "False", "reason": "PodCompleted", "lastTransitionTime": stamp}
            for t in ("ContainersReady", "Ready")
        ]
        self._pod_status(
            pod,
            {
                "status": {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "conditions": not_ready,
                    "containerStatuses": [self._container(run, ended)],
                }
            },
        )

    def _restart(self, run: _Run, pod: dict[str, Any]) -> None:
        c = run.c
        last = {"terminated": {"exitCode": c.exit_code, "startedAt": run.started_at}}
        argv, env = container_process(pod, self._secret, self._nodes[c.node].host_monitor_url)
        c.proc = launch(argv, env, c.log, self.log_dir / c.pod)
        c.exit_code = None
        run.restarts += 1
        run.started_at = now()
        status = self._container(run, {"running": self._since(run)}, lastState=last)
        self._pod_status(pod, {"status": {"containerStatuses": [status]}})

    def _remove(self, pod: dict[str, Any]) -> None:
        m = pod["metadata"]
        r = self._api.request(
            "DELETE",
            f"/api/v1/namespaces/{self.namespace}/pods/{m['name']}",
            json={"gracePeriodSeconds": 0, "preconditions": {"uid": m["uid"]}},
        )
        if r.status_code not in (404, 409):
            r.raise_for_status()

    def _secret(self, name: str, key: str) -> str:
        r = self._api.get(f"/api/v1/namespaces/{self.namespace}/secrets/{name}")
        r.raise_for_status()
        return base64.b64decode(r.json()["data"][key]).decode()
