"""A kubelet for FakeKube that runs real processes: the container runtime of the
end-to-end tests on the model (tests/kube_model_e2e.py).

FakeKube's own kubelet model only moves pod phases; no container ever runs. This bridge
plays, for the nodes it is given, the part of the kubelet that starts and stops
containers, with plain processes on this machine:

- **Start.** A pod bound to one of its nodes, `Running` (the fake kubelet has started
  it) and not being deleted gets its containers' `command` + `args` run as one process
  (its own session, output appended to `<log_dir>/<pod>.log`). The environment is the
  container's `env` as the kubelet builds it: `value`s with `$(VAR)` expanded from the
  variables before them (`$$` escapes), `fieldRef` (the downward API: `metadata.name`,
  `.namespace`, `.uid`, `.labels['k']`, `.annotations['k']`, `spec.nodeName`,
  `spec.serviceAccountName`, `status.hostIP`, `status.podIP`), `secretKeyRef` from the
  `secrets` given (FakeKube serves no Secrets); plus `JOB_COMPLETION_INDEX`, which the
  real Job controller writes into the pods of Indexed Jobs (the fake's does not), and
  `HOSTNAME`. `command`/`args` get the same `$(VAR)` expansion.
- **What a container cannot see here.** There is no image and no filesystem isolation:
  the process runs this interpreter (`python` on PATH is `sys.executable`'s), with the
  repository on PYTHONPATH, and paths in the env must be host paths (the test points
  the shared and per-node directories at its temporary directory). `HOST_MONITOR_URL`,
  when the container sets it, is replaced by the URL of the host monitor of the pod's
  node: what the node-local Service (internalTrafficPolicy Local) resolves to.
- **Stop.** A pod with `deletionTimestamp` (or gone from the API) gets SIGTERM to its
  process (the container's pid 1), and SIGKILL to its process group once
  `deletionGracePeriodSeconds` x FakeKube's `time_scale` has passed. Completing the
  deletion is left to the fake kubelet, which does it after the same grace period.
- **Exit.** A process that exits by itself while its pod is not being deleted is
  reported as the kubelet would: exit code 0 -> `succeed_pod`, else `fail_pod` with the
  code (128 + signal for a signal, e.g. 137 for SIGKILL), so the fake Job and JobSet
  controllers react.
- **A dead node** (`node_down`): its kubelet stops (nothing more is started, stopped or
  reported there), its processes get SIGKILL, and the Node turns NotReady.

Level-triggered, like the kubelet's sync loop: every `period` it compares the pods in
FakeKube (read directly, no HTTP) with the processes it runs, in one thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.kube import FakeKube
from tests.kube.resources import ApiError
from tests.timing import scaled

REPO = Path(__file__).resolve().parents[2]
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


@dataclass
class Container:
    """One pod's process."""

    pod: str
    uid: str
    node: str
    proc: subprocess.Popen[bytes]
    log: Path
    grace_s: float
    term_sent: float | None = None
    reported: bool = False
    exit_code: int | None = None


@dataclass
class _Node:
    host_monitor_url: str
    alive: bool = True


@dataclass
class KubeletBridge:
    kube: FakeKube
    log_dir: Path
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)
    namespace: str = "default"
    period: float = 0.05
    containers: dict[str, Container] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet-bridge", daemon=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # --- control --------------------------------------------------------------------------

    def add_node(self, node: str, host_monitor_url: str) -> None:
        """Run the containers of `node`'s pods, next to the host monitor at that URL."""
        with self._lock:
            self._nodes[node] = _Node(host_monitor_url)

    def node_down(self, node: str) -> None:
        """The node dies: its kubelet stops, its containers get SIGKILL, Node NotReady."""
        with self._lock:
            self._nodes[node].alive = False
            for c in self.containers.values():
                if c.node == node:
                    _kill_group(c.proc.pid)
        self.kube.set_node_ready(node, False)

    def start(self) -> KubeletBridge:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop syncing and SIGKILL every process started (and reap it)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(10)
        for c in self.containers.values():
            _kill_group(c.proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(5)

    def running(self, node: str | None = None) -> list[Container]:
        """Processes alive now (of `node`)."""
        with self._lock:
            return [
                c
                for c in self.containers.values()
                if c.proc.poll() is None and (node is None or c.node == node)
            ]

    # --- the sync loop --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                with self._lock:
                    self.sync()
            except Exception as exc:  # surfaced by the test, never swallowed
                self.errors.append(exc)
                return

    def sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.kube.objects("Pod", self.namespace)}
        now = time.monotonic()
        for uid, c in self.containers.items():
            node = self._nodes[c.node]
            if not node.alive:
                continue
            pod = pods.get(uid)
            code = c.proc.poll()
            deleting = pod is None or bool(pod["metadata"].get("deletionTimestamp"))
            if code is not None:
                if c.exit_code is None:
                    c.exit_code = code if code >= 0 else 128 - code
                if not c.reported and not deleting:
                    c.reported = True
                    self._report_exit(c)
                continue
            if deleting:
                if c.term_sent is None:
                    c.term_sent = now
                    if pod is not None:
                        grace = pod["metadata"].get("deletionGracePeriodSeconds")
                        if grace is not None:
                            c.grace_s = scaled(float(grace) * self.kube.api.time_scale)
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.send_signal(signal.SIGTERM)
                elif now - c.term_sent >= c.grace_s:
                    _kill_group(c.proc.pid)
        for uid, pod in pods.items():
            node_name = (pod.get("spec") or {}).get("nodeName")
            target = self._nodes.get(node_name or "")
            if (
                uid in self.containers
                or target is None
                or not target.alive
                or pod["metadata"].get("deletionTimestamp")
                or (pod.get("status") or {}).get("phase") != "Running"
            ):
                continue
            self.containers[uid] = self._start(pod, node_name or "", target)

    def _report_exit(self, c: Container) -> None:
        for _ in range(10):  # a status write races the fake's controllers: 409, read again
            pod = self.kube.get("Pod", c.pod, self.namespace)
            if pod is None or pod["metadata"]["uid"] != c.uid:
                return  # deleted meanwhile: nothing left to report on
            try:
                if c.exit_code == 0:
                    self.kube.succeed_pod(c.pod, self.namespace)
                else:
                    self.kube.fail_pod(c.pod, self.namespace, exit_code=c.exit_code or 1)
                return
            except KeyError:
                return
            except ApiError as exc:
                if exc.code != 409:
                    raise
        raise RuntimeError(f"could not report the exit of pod {c.pod}")

    # --- one container ----------------------------------------------------------------------

    def _start(self, pod: dict[str, Any], node_name: str, node: _Node) -> Container:
        m, spec = pod["metadata"], pod.get("spec") or {}
        argv, env = container_process(
            pod, lambda name, key: self.secrets[(name, key)], node.host_monitor_url
        )
        log = self.log_dir / f"{m['name']}.log"
        proc = launch(argv, env, log, self.log_dir / m["name"])
        # Compressed by FakeKube's time_scale (30 s: 1.5 s), then stretched like the tests'
        # margins: a worker's orderly exit took longer than 1.5 s on a loaded machine.
        grace = scaled(
            float(spec.get("terminationGracePeriodSeconds", 30)) * self.kube.api.time_scale
        )
        return Container(m["name"], m["uid"], node_name, proc, log, grace)


def container_process(
    pod: dict[str, Any], secret: Callable[[str, str], str], host_monitor_url: str
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the pod's one container, as the kubelet builds them
    (`secret(name, key)` reads a Secret's key), with this machine's interpreter and the
    repository on the path."""
    m, spec = pod["metadata"], pod.get("spec") or {}
    (container,) = spec.get("containers") or []  # one container per worker pod
    env: dict[str, str] = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "HOME": os.environ.get("HOME", "/"),
        "HOSTNAME": spec.get("hostname") or m["name"],
    }
    index = (m.get("annotations") or {}).get(COMPLETION_INDEX)
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = index
    for var in container.get("env") or []:
        env[var["name"]] = _value(var, pod, env, secret)
    if "HOST_MONITOR_URL" in env:
        env["HOST_MONITOR_URL"] = host_monitor_url
    argv = [
        _expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])
    ]
    return argv, env


def launch(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """The container's process: a session of its own, output appended to `log`."""
    cwd.mkdir(exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _value(
    var: dict[str, Any],
    pod: dict[str, Any],
    env: dict[str, str],
    secret: Callable[[str, str], str],
) -> str:
    if "value" in var:
        return _expand(str(var["value"]), env)
    source = var.get("valueFrom") or {}
    if "fieldRef" in source:
        return _field(pod, source["fieldRef"]["fieldPath"])
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return secret(ref["name"], ref["key"])
    raise ValueError(f"env {var['name']}: unsupported source {sorted(source)}")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables only, `$$` -> `$`."""

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    return _VAR.sub(one, text)


def _field(pod: dict[str, Any], path: str) -> str:
    m = pod["metadata"]
    found = _FIELD.match(path)
    if found:
        return str((m.get(found[1]) or {}).get(found[2], ""))
    simple = {
        "metadata.name": m.get("name"),
        "metadata.namespace": m.get("namespace"),
        "metadata.uid": m.get("uid"),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
        "status.hostIP": (pod.get("status") or {}).get("hostIP"),
        "status.podIP": (pod.get("status") or {}).get("podIP"),
    }
    if path not in simple:
        raise ValueError(f"fieldRef {path!r} is not supported")
    return str(simple[path] or "")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
