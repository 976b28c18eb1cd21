"""Runs the whole loop on one machine: host monitors as nodes, a real training job on
them, and the supervisor, each a separate process.

The supervisor is a child like the nodes, not their parent, so it can be killed and
started again while the job keeps running, as in production. A node that dies
(`node_down`) is "repaired" after `node_repair_s`: its host monitor starts again under
the same name and port, as a spare.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.shared_settings import host_monitor_env
from supervisor.local.cluster import LocalCluster
from supervisor.local.cluster_state import ClusterState, NodeInfo
from supervisor.local.demo_options import DemoOptions
from supervisor.local.ports import free_port, hold_port
from supervisor.local.processes import LocalProcess, ProcessStarter, start_process
from supervisor.local.run_folder import claim

RUN_MARKER = "SUPERVISOR_LOCAL_RUN"
#: How long the job's first start waits for its nodes' warm standbys (their imports, once
#: per node) before it launches the ranks of a node still importing.
BOOT_STANDBY_WAIT_S = 60.0


def node_checkpoint_root(run_dir: Path, node: str) -> Path:
    """The `checkpoint_root` of a local node's host monitor: its "RAM" (a directory of the
    run, emptied when the node is repaired, as a reboot empties a tmpfs)."""
    return run_dir / "nodes" / node / Tier.RAM


def node_peer_store(run_dir: Path, node: str) -> Path:
    """Where a local node's host monitor keeps the copies its partner sends it."""
    return run_dir / "nodes" / node / Tier.PEER


class LocalDemo:
    def __init__(self, options: DemoOptions, start: ProcessStarter = start_process) -> None:
        self.options = options
        self._start = start
        self.run_dir = options.run_dir.resolve()
        self.agent_token = secrets.token_urlsafe(24)
        self.operator_token = secrets.token_urlsafe(24)
        self.actuator_token = secrets.token_urlsafe(24)
        self.peer_token = secrets.token_urlsafe(24)  # shared by the nodes' host monitors
        self.url = f"http://{options.host('supervisor')[1]}:{options.port}"
        self.node_ports: dict[str, int] = {}
        self.monitors: dict[str, LocalProcess] = {}
        self.supervisor: LocalProcess | None = None
        self._down_since: dict[str, float] = {}
        self._folder: IO[bytes] | None = None  # the run folder's marker, locked while we run
        self._client: httpx.Client | None = None
        self._port_hold: socket.socket | None = None

    @property
    def http(self) -> httpx.Client:
        """One client for every request to the supervisor and the host monitors: a client
        made per request (httpx.get) builds a TLS context each time, about 45 ms of CPU,
        which polling several times a second turned into half a core."""
        if self._client is None:
            self._client = httpx.Client(timeout=5)
        return self._client

    # --- processes ----------------------------------------------------------------------

    def _log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def start_monitor(self, node: str) -> None:
        o = self.options
        port = self.node_ports.setdefault(node, free_port())
        node_dir = self.run_dir / "nodes" / node
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "kmsg.log").touch()
        ram, peer_store = (
            node_checkpoint_root(self.run_dir, node),
            node_peer_store(self.run_dir, node),
        )
        for volatile in (ram, peer_store):
            # A node that comes back (repaired) has lost what it held in RAM.
            shutil.rmtree(volatile, ignore_errors=True)
        ram.mkdir()
        settings = {
            "node": node,
            "supervisor_url": self.url,
            "agent_token": self.agent_token,
            "actuator_token": self.actuator_token,
            "host": o.host(node)[1],
            "host_daemon_port": str(port),
            "heartbeat_polling_period_s": str(o.heartbeat_polling_period_s),
            "worker_heartbeat_timeout_s": str(
                o.worker_heartbeat_timeout_s or max(2.0, o.heartbeat_timeout_s)
            ),
            "initial_state": "spare",
            "kernel_log": str(node_dir / "kmsg.log"),
            "watchdog_period_s": "0.5",
            "run_dir": str(node_dir),
            "peer_token": self.peer_token,
            "checkpoint_root": str(ram),
            "peer_store_dir": str(peer_store),
        }
        env = {host_monitor_env(name): value for name, value in settings.items()}
        self.monitors[node] = self._start(
            [*o.host(node)[0], sys.executable, "-m", "host_monitor.cli"],
            {**os.environ, RUN_MARKER: str(self.run_dir), **env},
            self._log(f"host-monitor-{node}"),
        )

    def start_supervisor(self) -> None:
        o = self.options
        env = {
            "SUPERVISOR_BACKEND": "local",
            "SUPERVISOR_LOCAL_RUN_DIR": str(self.run_dir),
            "SUPERVISOR_DATABASE_URL": f"sqlite:///{self.run_dir}/supervisor.db",
            "SUPERVISOR_AGENT_TOKEN": self.agent_token,
            "SUPERVISOR_OPERATOR_TOKEN": self.operator_token,
            "SUPERVISOR_ENABLE_FAULT_INJECTION": "true",
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": str(o.heartbeat_polling_period_s),
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": str(o.heartbeat_timeout_s),
            "SUPERVISOR_NUM_DP_REPLICAS": str(o.replicas),
            "SUPERVISOR_MIN_NUM_DP_REPLICAS": "1",
            "SUPERVISOR_MAX_NUM_DP_REPLICAS": str(o.replicas),
            "SUPERVISOR_NUM_NODES_PER_DP": str(o.nodes_per_dp),
            "SUPERVISOR_ENABLE_WORKLOAD_SCALING": "true",
            "SUPERVISOR_EMERGENCY_CHECKPOINT_TIMEOUT_S": "10",
            # Room for an in-process restart's bound and the full restart after it.
            "SUPERVISOR_ACTION_TIMEOUT_S": "150",
            "SUPERVISOR_LOCAL_STOP_GRACE_S": "2",
            "SUPERVISOR_HANG_MIN_TIMEOUT_S": "10",
            "SUPERVISOR_POLICY": o.policy,
            **o.supervisor_env,
        }
        prefix, address = o.host("supervisor")
        args = [
            *prefix,
            *[sys.executable, "-m", "supervisor.cli", "serve"],
            *["--host", address, "--port", str(o.port)],
        ]
        # A stray SUPERVISOR_* setting in the caller's shell must not change the demo.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
        self.supervisor = self._start(
            args, {**clean, RUN_MARKER: str(self.run_dir), **env}, self._log("supervisor")
        )

    def restart_supervisor(self) -> int:
        """Start the supervisor again (after it exited, or was killed), wait for it; its pid."""
        if self.supervisor is not None and self.supervisor.poll() is None:
            self.supervisor.kill()
            self.supervisor.wait()
        self.start_supervisor()
        self.wait_ready(f"{self.url}/readyz", process=("supervisor", self.supervisor))
        assert self.supervisor is not None
        return self.supervisor.pid

    def wait_ready(
        self,
        url: str,
        timeout_s: float = 30.0,
        headers: dict[str, str] | None = None,
        process: tuple[str, LocalProcess | None] | None = None,
    ) -> None:
        """Until `url` answers 200; `process`, (its log's name, the process) that serves it:
        one that exited is said at once, with its log, rather than waited on."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None:
                self._check_running(*process)
            try:
                if self.http.get(url, timeout=1, headers=headers).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"{url} did not answer within {timeout_s:g}s (logs in {self.run_dir}/logs)"
        )

    def _check_running(self, name: str, proc: LocalProcess | None) -> None:
        code = None if proc is None else proc.poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with code {code} (its log: {self._log(name)})")

    def _node_url(self, node: str) -> str:
        return f"http://{self.options.host(node)[1]}:{self.node_ports[node]}"

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        o = self.options
        prefix, address = o.host("supervisor")
        if not prefix:
            # The supervisor's port is ours from now on, through its restarts: chosen by
            # the caller, it was free when chosen, and the supervisor binds it only after
            # the nodes and the job have started, tens of seconds later on a loaded
            # machine, when another program may have taken it and answered for it.
            try:
                self._port_hold = hold_port(address, o.port)
            except OSError as exc:
                raise RuntimeError(f"the supervisor's {exc.strerror} (the demo's --port)") from exc
        # Only a new or empty folder, or a previous run's (RunFolderError else).
        self._folder = claim(self.run_dir)
        (self.run_dir / "logs").mkdir()
        for node in o.nodes:
            self.start_monitor(node)
        auth = {"Authorization": f"Bearer {self.actuator_token}"}
        for node in o.nodes:
            monitor = (f"host-monitor-{node}", self.monitors[node])
            self.wait_ready(f"{self._node_url(node)}/v1/status", headers=auth, process=monitor)
        placement = o.nodes[: o.replicas * o.nodes_per_dp]
        state = ClusterState(
            run_dir=str(self.run_dir),
            actuator_token=self.actuator_token,
            nodes={
                n: NodeInfo(
                    address=self._node_url(n),
                    checkpoint_root=str(node_checkpoint_root(self.run_dir, n)),
                )
                for n in o.nodes
            },
            job=o.job_spec(placement),
        )
        state.save()
        asyncio.run(self._start_job(state))
        self.start_supervisor()
        self.wait_ready(f"{self.url}/readyz", process=("supervisor", self.supervisor))
        self.wait_known()

    def wait_known(self, within_s: float = 30.0) -> None:
        """Until the supervisor knows every node (their first heartbeats): from then on it
        answers for them (faults, cordons), and a spare is one the policy can swap in. A
        host monitor retries its heartbeats with a backoff while the supervisor starts, so
        a ready supervisor may not know a spare yet."""
        deadline = time.monotonic() + within_s
        wanted = set(self.options.nodes)
        known: set[str] = set()
        problem = ""
        while time.monotonic() < deadline:
            self._check_running("supervisor", self.supervisor)
            try:
                known = {node["name"] for node in self.api("/api/v1/nodes")}
            except (httpx.HTTPError, ValueError) as exc:
                problem = f"; its API last answered {type(exc).__name__}: {exc}"
            else:
                if wanted <= known:
                    return
                problem = ""
            time.sleep(0.1)  # restarting, or not heard yet: asked again
        raise RuntimeError(
            f"the supervisor did not hear from every node within {within_s:g}s: "
            f"{', '.join(sorted(wanted - known))} unheard{problem} (logs in {self.run_dir}/logs)"
        )

    async def _start_job(self, state: ClusterState) -> None:
        cluster = LocalCluster(state)
        try:
            if state.job is not None:  # its first start forks its ranks (warm_standbys)
                await cluster.warm_standbys(state.job, state.job.placement, BOOT_STANDBY_WAIT_S)
            await cluster.restart_job("boot")
        finally:
            await cluster.close()

    def repair_nodes(self) -> list[str]:
        """Bring back nodes that died more than node_repair_s ago, as a technician would:
        return the node to the pool (uncordon, through the operator API), then boot it
        (its host monitor starts again, as a spare) and ready it for the job (its warm
        standby, see `warm_spare`)."""
        repaired = []
        now = time.monotonic()
        for node, proc in list(self.monitors.items()):
            if proc.poll() is None:
                self._down_since.pop(node, None)
                continue
            since = self._down_since.setdefault(node, now)
            if now - since < self.options.node_repair_s:
                continue
            try:
                self.operator_action(
                    {"type": "uncordon", "node": node, "reason": "repaired"},
                    key=f"repair-{node}-{int(since)}",
                )
            except httpx.HTTPError:
                continue  # the supervisor is not answering: try again on the next pass
            self.start_monitor(node)
            self._down_since.pop(node, None)
            self.warm_spare(node)
            repaired.append(node)
        return repaired

    def warm_spare(self, node: str) -> bool:
        """Once the node answers, have it keep a warm standby of the job (a spare the job
        may get: host_monitor/standby.py); the backend does the same for the spares it
        sees after each restart. False when the job has none or the node did not answer."""
        try:
            state = ClusterState.load(self.run_dir)
        except (OSError, ValueError):
            return False
        job = state.job
        if job is None or not job.standby_preload:
            return False
        try:
            self.wait_ready(f"{self._node_url(node)}/healthz", timeout_s=15.0)
            response = self.http.post(
                f"{self._node_url(node)}/v1/standby",
                json={
                    "job": job.name,
                    "command": job.command,
                    "env": job.env,
                    "preload": job.standby_preload,
                },
                headers={"Authorization": f"Bearer {self.actuator_token}"},
                timeout=5,
            )
        except (RuntimeError, httpx.HTTPError):
            return False
        return response.status_code == 200

    def operator_action(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        """Ask for an action through the API and wait until it finished."""
        headers = {"Authorization": f"Bearer {self.operator_token}", "Idempotency-Key": key}
        response = self.http.post(f"{self.url}/api/v1/actions", json=body, headers=headers)
        response.raise_for_status()
        action: dict[str, Any] = response.json()
        deadline = time.monotonic() + 30
        while action["status"] not in ("succeeded", "failed") and time.monotonic() < deadline:
            time.sleep(0.05)
            action = self.api(f"/api/v1/actions/{action['id']}")
        return action

    def kill_supervisor(self) -> None:
        if self.supervisor is not None and self.supervisor.poll() is None:
            self.supervisor.send_signal(signal.SIGKILL)
            self.supervisor.wait(10)

    def stop(self) -> None:
        """Stop everything we started, and anything they started (no orphans)."""
        procs = [p for p in [self.supervisor, *self.monitors.values()] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        # Until none is left: a killed process takes a moment to go (one in the kernel,
        # writing a checkpoint, dies on its way out), and one may have been starting a
        # child of its own while the first scan ran.
        deadline = time.monotonic() + 10
        while (left := leftover_processes(self.run_dir)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if self._port_hold is not None:
            self._port_hold.close()
            self._port_hold = None
        if self._folder is not None:
            self._folder.close()  # another run may take the folder now
            self._folder = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- reads for the banner and tests --------------------------------------------------

    def api(self, path: str, **params: Any) -> Any:
        response = self.http.get(
            f"{self.url}{path}",
            params=params,
            headers={"Authorization": f"Bearer {self.operator_token}"},
        )
        response.raise_for_status()
        return response.json()


def leftover_processes(run_dir: Path) -> list[int]:
    """Processes still carrying this run's marker in their environment."""
    marker = f"{RUN_MARKER}={run_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found
