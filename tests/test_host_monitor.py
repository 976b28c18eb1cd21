"""The host monitor end to end: real agent processes, real workers, a real supervisor.

Each test starts `python -m host_monitor.cli` (port 0, tiny periods) against one
`supervisor serve` process shared by the module, and drives it over HTTP. Workers are
tiny scripts (plain httpx) that register, report steps and ack emergency checkpoints.
Every process is killed by process group at teardown; workers also exit on their own
when their host monitor is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.local.ports import free_port
from supervisor.local.processes import LocalProcess
from tests.forked_ranks import RankProcess
from tests.forked_services import start_service
from tests.http import http
from tests.timing import scaled

AGENT_TOKEN = "hm-test-agent-token"
NODE_KEY = "hm-test-node-key-0123456789abcdef0123"
OPERATOR_TOKEN = "hm-test-operator-token"
ACTUATOR_TOKEN = "hm-test-actuator-token"
WORKER_TOKEN = "hm-test-worker-token"
ACTUATOR = {"Authorization": f"Bearer {ACTUATOR_TOKEN}"}
WORKER = {"Authorization": f"Bearer {WORKER_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}

# A worker: registers, reports a step every 50 ms, acks emergency checkpoints with the
# id from HOST_MONITOR_REQUEST_FILE, and exits when its host monitor has been
# unreachable for 3 s. Per-rank behaviour from env: NO_ACK_RANKS never ack,
# IGNORE_TERM_RANKS ignore SIGTERM, USR1_DIR counts SIGUSR1s.
WORKER_SCRIPT = r"""
import os, signal, sys, time
from pathlib import Path
import httpx

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
def ranks(name):
    return {int(r) for r in os.environ.get(name, "").split(",") if r}
Path(os.environ["PID_DIR"], str(os.getpid())).write_text(str(rank))
client = httpx.Client(
    base_url=os.environ["HOST_MONITOR_URL"],
    headers={"Authorization": "Bearer " + os.environ["HOST_MONITOR_WORKER_TOKEN"]},
    timeout=2,
)
signals = []
signal.signal(signal.SIGUSR1, lambda *_: signals.append(1))
if rank in ranks("IGNORE_TERM_RANKS"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
body = {"rank": rank, "local_rank": local_rank, "pid": os.getpid()}
# It handles SIGUSR1 (above): only such a worker is signalled.
body["emergency_checkpoints"] = True
client.post("/v1/workers/register", json=body).raise_for_status()
step, last_ok, usr1 = 0, time.monotonic(), 0
while True:
    if signals:
        signals.clear()
        usr1 += 1
        if os.environ.get("USR1_DIR"):
            Path(os.environ["USR1_DIR"], f"rank{rank}").write_text(str(usr1))
        if rank not in ranks("NO_ACK_RANKS"):
            request_id = Path(os.environ["HOST_MONITOR_REQUEST_FILE"]).read_text().strip()
            body = {"request_id": request_id, "ok": True, "step": step, "duration_s": 0.01}
            client.post(f"/v1/workers/{rank}/emergency-ack", json=body)
    try:
        client.post(f"/v1/workers/{rank}/progress", json={"step": step, "compute_s": 0.05})
        last_ok = time.monotonic()
    except httpx.HTTPError:
        if time.monotonic() - last_ok > 3:
            sys.exit(3)
    step += 1
    time.sleep(0.05)
"""


def wait_for(predicate: Callable[[], Any], within: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + scaled(within)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {within}s")
        time.sleep(0.05)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# --- the supervisor -----------------------------------------------------------------------


class Supervisor:
    def __init__(
        self, tmp: Path, port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"supervisor-{self.port}.log"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
            "SUPERVISOR_DATABASE_URL": f"sqlite:///{tmp}/supervisor-{self.port}.db",
            "SUPERVISOR_AGENT_TOKEN": AGENT_TOKEN,
            "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN,
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": "0.1",
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": "1",
            # The shared token, and node credentials (test_a_node_credential_...).
            "SUPERVISOR_AGENT_AUTH": "shared,node_key",
            "SUPERVISOR_NODE_KEY": NODE_KEY,
            **(env or {}),
        }
        self.proc: RankProcess | None = None
        self.http = httpx.Client(base_url=self.url, headers=OPERATOR, timeout=5)

    def start(self) -> None:
        args = ["serve", "--port", str(self.port)]
        self.proc = start_service("supervisor.cli", args, self.env, self.log)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                return http.get(f"{self.url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, 30, "supervisor ready")

    def stop(self) -> None:
        self.http.close()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
                self.proc.wait(5)

    def node(self, name: str) -> dict[str, Any] | None:
        r = self.http.get(f"/api/v1/nodes/{name}")
        return r.json() if r.status_code == 200 else None

    def events(self, node: str, type_: str) -> list[dict[str, Any]]:
        r = self.http.get("/api/v1/events", params={"node": node, "type": type_})
        if r.status_code == 404:  # the node is not known yet
            return []
        assert r.status_code == 200, r.text
        return r.json()["items"][::-1]  # type: ignore[no-any-return]

    def wait_event(self, node: str, type_: str, within: float = 5.0) -> dict[str, Any]:
        events = wait_for(lambda: self.events(node, type_), within, f"{type_} event of {node}")
        return events[0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    server = Supervisor(tmp_path_factory.mktemp("supervisor"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


# --- the host monitor ---------------------------------------------------------------------


class Agent:
    def __init__(self, node: str, proc: LocalProcess, url: str, log: Path) -> None:
        self.node = node
        self.proc = proc
        self.url = url
        self.log = log
        self.api = httpx.Client(base_url=url, headers=ACTUATOR, timeout=10)
        self.worker_api = httpx.Client(base_url=url, headers=WORKER, timeout=5)

    def status(self) -> dict[str, Any]:
        r = self.api.get("/v1/status")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def workers(self) -> dict[int, dict[str, Any]]:
        return {w["rank"]: w for w in self.status()["workers"]}

    def fault(self, **body: Any) -> dict[str, Any]:
        r = self.api.post("/v1/faults", json=body)
        assert r.status_code == 202, r.text
        return r.json()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.api.close()
        self.worker_api.close()


class Cluster:
    """Starts agents and their workers; kills every process group it made at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.pid_dir = tmp / "pids"
        self.pid_dir.mkdir()
        self.usr1_dir = tmp / "usr1"
        self.usr1_dir.mkdir()
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER_SCRIPT)
        self.agents: list[Agent] = []

    def start_agent(
        self,
        supervisor_url: str | None,
        *,
        node: str | None = None,
        env: dict[str, str] | None = None,
        fresh: bool = False,
        **flags: Any,
    ) -> Agent:
        """A host monitor forked by the tests' standby (tests/forked_services.py), or a new
        interpreter when `fresh`: where its memory is measured, as a forked process's pages
        are its standby's until it writes them."""
        node = node or f"hm-{uuid.uuid4().hex[:8]}"
        settings: dict[str, Any] = {
            "node": node,
            "port": 0,
            "heartbeat_polling_period_s": 0.2,
            "worker_heartbeat_timeout_s": 1.0,
            "watchdog_period_s": 0.1,
            "kernel_log": self.tmp / f"{node}.kern.log",
            "nvidia_smi": self.tmp / "no-nvidia-smi-here",
            "run_dir": self.tmp / "run",
            "shutdown_grace_s": 1.0,
        }
        if supervisor_url is not None:
            settings["supervisor_url"] = supervisor_url
        settings.update(flags)
        args = []
        for name, value in settings.items():
            if value is not None:
                args += [f"--{name.replace('_', '-')}", str(value)]
        # Tokens through the environment, as in production (flags show in `ps`); an empty
        # value in `env` leaves the variable out.
        full_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HOST_MONITOR_")},
            "HOST_MONITOR_AGENT_TOKEN": AGENT_TOKEN,
            "HOST_MONITOR_ACTUATOR_TOKEN": ACTUATOR_TOKEN,
            "HOST_MONITOR_WORKER_TOKEN": WORKER_TOKEN,
            **(env or {}),
        }
        full_env = {k: v for k, v in full_env.items() if v}
        log = self.tmp / f"{node}.agent.log"
        # A node's host monitor started again appends to its file: its own lines only.
        start = log.stat().st_size if log.exists() else 0
        proc: LocalProcess
        if fresh:
            with log.open("ab") as out:
                command = [sys.executable, "-m", "host_monitor.cli", *args]
                proc = subprocess.Popen(
                    command, env=full_env, stdout=out, stderr=out, start_new_session=True
                )
        else:
            proc = start_service("host_monitor.cli", args, full_env, log)
        # It says where it listens on stdout, once it does (its port is its own choice).
        prefix = f"host-monitor {node} listening on "

        def listening() -> str | bool:
            # Whole lines only: one being written may be read in part.
            with log.open("rb") as file:
                file.seek(start)
                lines = file.read().decode(errors="replace").splitlines(keepends=True)
            said = [x.strip() for x in lines if prefix in x and x.endswith("\n")]
            return said[0] if said else proc.poll() is not None

        text: str | bool = False
        with contextlib.suppress(AssertionError):  # a host monitor's start, loaded
            text = wait_for(listening, 15, "the agent listening")
        if not isinstance(text, str):
            proc.kill()
            raise AssertionError(f"agent did not start (exit {proc.poll()}):\n{log.read_text()}")
        assert text.startswith(prefix), text
        agent = Agent(node, proc, text.removeprefix(prefix), log)
        self.agents.append(agent)
        return agent

    def start_workers(
        self,
        agent: Agent,
        ranks: list[int],
        *,
        job: str = "j1",
        request_id: str | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body = {
            "request_id": request_id or uuid.uuid4().hex,
            "job": job,
            "command": [sys.executable, str(self.script)],
            "env": {"PID_DIR": str(self.pid_dir), "USR1_DIR": str(self.usr1_dir), **(env or {})},
            "workers": [{"rank": r, "local_rank": i} for i, r in enumerate(ranks)],
        }
        r = agent.api.post("/v1/workers/start", json=body)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def wait_running(self, agent: Agent, ranks: list[int], min_step: int = 1) -> None:
        def running() -> bool:
            workers = agent.workers()
            return all(
                workers.get(r, {}).get("state") == "running"
                and (workers[r]["step"] or 0) >= min_step
                for r in ranks
            )

        wait_for(running, 10, f"ranks {ranks} running")

    def worker_pids(self) -> list[int]:
        return [int(p.name) for p in self.pid_dir.iterdir()]

    def teardown(self) -> None:
        for agent in self.agents:
            agent.close()
            if agent.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    agent.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.proc.wait(5)
            _kill_group(agent.proc.pid)
            agent.proc.wait(5)
        for pid in self.worker_pids():
            _kill_group(pid)  # workers lead their own process group


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.teardown()


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False


# --- tests --------------------------------------------------------------------------------


def test_started_workers_register_and_their_steps_reach_the_supervisor(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    agent = cluster.start_agent(supervisor.url)
    supervisor.wait_event(agent.node, "spare_available")
    assert agent.status() == {"node": agent.node, "state": "spare", "job": None, "workers": []}

    started = cluster.start_workers(agent, [0, 1], request_id="start-1")
    assert started["state"] == "running" and started["job"] == "j1"
    assert [w["state"] for w in started["workers"]] == ["starting", "starting"]
    cluster.wait_running(agent, [0, 1], min_step=3)

    def seen() -> dict[str, Any] | None:
        node = supervisor.node(agent.node)
        if node is None or node["state"] != "running":
            return None
        workers = node["workers"]
        ok = len(workers) == 2 and all(w["state"] == "running" and w["step"] for w in workers)
        return node if ok else None

    node = wait_for(seen, 5, "workers running at the supervisor")
    assert node["job"] == "j1" and node["alive"]
    pids = {w["rank"]: w["pid"] for w in agent.status()["workers"]}
    assert {w["rank"]: w["pid"] for w in node["workers"]} == pids
    assert sorted(int(p) for p in cluster.worker_pids()) == sorted(pids.values())

    # The workers got the node's URL, token, ranks and request file in their env.
    environ = Path(f"/proc/{pids[1]}/environ").read_bytes().split(b"\0")
    assert b"RANK=1" in environ and b"LOCAL_RANK=1" in environ
    assert f"NODE_NAME={agent.node}".encode() in environ
    assert f"HOST_MONITOR_URL={agent.url}".encode() in environ
    assert not any(e.startswith((b"HOST_MONITOR_AGENT", b"HOST_MONITOR_ACTUATOR")) for e in environ)
    log = cluster.tmp / "run" / f"{agent.node}.j1.rank0.log"
    assert "=== host-monitor: start start-1" in log.read_text()

    # Idempotent by request_id: the same start again launches nothing.
    again = cluster.start_workers(agent, [0, 1], request_id="start-1")
    assert {w["rank"]: w["pid"] for w in again["workers"]} == pids
    body = {
        "request_id": "start-1",
        "job": "j1",
        "command": ["true"],
        "workers": [{"rank": 0, "local_rank": 0}],
    }
    r = agent.api.post("/v1/workers/start", json=body)
    assert r.status_code == 409 and "different" in r.json()["detail"]
    r = agent.api.post("/v1/workers/start", json={**body, "request_id": "start-2"})
    assert r.status_code == 409 and "still running" in r.json()["detail"]
    bad = {**body, "request_id": "start-3", "command": ["/nonexistent/trainer"], "job": "j1"}
    r = agent.api.post("/v1/workers/start", json={**bad, "workers": [{"rank": 5, "local_rank": 2}]})
    assert r.status_code == 422 and r.json()["message"].startswith("command: cannot run")
    assert len(cluster.worker_pids()) == 2
    r = agent.api.post("/v1/workers/start", json={**bad, "env": {"A=B": "x"}})
    assert r.status_code == 422 and r.json()["message"].startswith("env.A=B:")


def test_worker_crash_is_reported_as_worker_exited(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    agent = cluster.start_agent(supervisor.url)
    cluster.start_workers(agent, [0, 1])
    cluster.wait_running(agent, [0, 1])
    victim = agent.workers()[1]["pid"]

    crashed_at = time.monotonic()
    outcome = agent.fault(kind="worker_crash", rank=1)
    assert outcome["rank"] == 1 and outcome["pid"] == victim and "SIGKILL" in outcome["detail"]
    event = supervisor.wait_event(agent.node, "worker_exited")
    detected_in = time.monotonic() - crashed_at
    assert event["rank"] == 1 and event["details"]["exit_code"] == -signal.SIGKILL
    assert event["details"]["pid"] == victim
    # Seen by the 0.1 s process poll and sent at once, not at the next period.
    assert detected_in < 2.0, detected_in
    workers = agent.workers()
    assert workers[1]["state"] == "exited" and workers[1]["exit_code"] == -9
    assert workers[0]["state"] == "running"

    # Default target: the lowest live rank.
    assert agent.fault(kind="worker_crash")["rank"] == 0
    r = agent.api.post("/v1/faults", json={"kind": "worker_crash", "rank": 1})
    assert r.status_code == 409  # already dead
    r = agent.api.post("/v1/faults", json={"kind": "worker_crash", "rank": 7})
    assert r.status_code == 404


def test_hung_worker_turns_lost_and_stop_still_ends_it(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    agent = cluster.start_agent(supervisor.url)
    cluster.start_workers(agent, [0, 1])
    cluster.wait_running(agent, [0, 1])

    agent.fault(kind="worker_hang", rank=0)
    wait_for(lambda: agent.workers()[0]["state"] == "lost", 5, "rank 0 lost")
    event = supervisor.wait_event(agent.node, "worker_heartbeat_lost")
    assert event["rank"] == 0
    assert agent.workers()[1]["state"] == "running"

    # A stopped (SIGSTOP) process only acts on SIGTERM once continued: stop does both.
    result = agent.api.post("/v1/workers/stop", json={"grace_s": 2})
    assert result.status_code == 200, result.text
    assert result.json()["exit_codes"] == {"0": -15, "1": -15}
    assert all(_pid_gone(p) for p in cluster.worker_pids())


def test_emergency_checkpoint_rounds(supervisor: Supervisor, cluster: Cluster) -> None:
    agent = cluster.start_agent(supervisor.url)
    cluster.start_workers(agent, [0, 1, 2], env={"NO_ACK_RANKS": "2"})
    cluster.wait_running(agent, [0, 1, 2])

    r = agent.api.post("/v1/emergency-checkpoint", json={"request_id": "ec-1", "timeout_s": 1})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["request_id"] == "ec-1"
    assert sorted(first["acked"]) == ["0", "1"] and first["missing"] == [2]
    assert all(a["ok"] and a["request_id"] == "ec-1" for a in first["acked"].values())
    assert 1.0 <= first["elapsed_s"] < 2.0

    # The same request_id again: the same round, answered at once, no new signal.
    again = agent.api.post("/v1/emergency-checkpoint", json={"request_id": "ec-1", "timeout_s": 5})
    assert again.json() == first
    assert {p.name: p.read_text() for p in cluster.usr1_dir.iterdir()} == {
        "rank0": "1",
        "rank1": "1",
        "rank2": "1",
    }

    # A dead worker is not waited for: the round ends as soon as the live ones acked.
    agent.fault(kind="worker_crash", rank=2)
    wait_for(lambda: agent.workers()[2]["state"] == "exited", 5, "rank 2 exited")
    started = time.monotonic()
    r = agent.api.post("/v1/emergency-checkpoint", json={"request_id": "ec-2", "timeout_s": 10})
    second = r.json()
    assert sorted(second["acked"]) == ["0", "1"] and second["missing"] == []
    assert time.monotonic() - started < 3 and second["elapsed_s"] < 3

    # Late or stray acks: unknown round with no open one -> 404; a finished round -> not counted.
    r = agent.worker_api.post(
        "/v1/workers/0/emergency-ack", json={"request_id": "nope", "ok": True}
    )
    assert r.status_code == 404
    r = agent.worker_api.post(
        "/v1/workers/2/emergency-ack", json={"request_id": "ec-1", "ok": True}
    )
    assert r.status_code == 200 and r.json() == {"request_id": "ec-1", "accepted": False}
    r = agent.worker_api.get("/v1/workers/0/emergency")
    assert r.json() == {"request_id": None, "remaining_s": None}


def test_stop_with_grace_then_release_makes_a_spare(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    agent = cluster.start_agent(supervisor.url)
    cluster.start_workers(agent, [0, 1], env={"IGNORE_TERM_RANKS": "1"})
    cluster.wait_running(agent, [0, 1])
    wait_for(lambda: (supervisor.node(agent.node) or {}).get("state") == "running", 5, "running")

    started = time.monotonic()
    r = agent.api.post("/v1/workers/stop", json={"grace_s": 0.5})
    took = time.monotonic() - started
    assert r.status_code == 200, r.text
    # Rank 0 ends on SIGTERM; rank 1 ignores it and is SIGKILLed after the grace period.
    assert r.json() == {"exit_codes": {"0": -15, "1": -9}}
    assert 0.5 <= took < 3, took
    status = agent.status()
    assert status["state"] == "running" and status["job"] == "j1"
    assert [(w["state"], w["exit_code"]) for w in status["workers"]] == [
        ("stopped", -15),
        ("stopped", -9),
    ]
    wait_for(
        lambda: (
            [w["state"] for w in (supervisor.node(agent.node) or {}).get("workers", [])]
            == ["stopped", "stopped"]
        ),
        5,
        "stopped workers at the supervisor",
    )
    assert supervisor.events(agent.node, "worker_exited") == []  # our stop is no failure
    spares_before = len(supervisor.events(agent.node, "spare_available"))

    r = agent.api.post("/v1/workers/stop", json={"grace_s": 0.5, "release": True})
    assert r.status_code == 200 and r.json() == {"exit_codes": {"0": -15, "1": -9}}
    assert agent.status() == {"node": agent.node, "state": "spare", "job": None, "workers": []}
    wait_for(
        lambda: len(supervisor.events(agent.node, "spare_available")) == spares_before + 1,
        5,
        "spare_available after release",
    )
    node = supervisor.node(agent.node)
    assert node is not None and node["state"] == "spare" and node["workers"] == []


def test_xid_fault_goes_through_the_kernel_log(supervisor: Supervisor, cluster: Cluster) -> None:
    agent = cluster.start_agent(supervisor.url)
    cluster.start_workers(agent, [0])
    cluster.wait_running(agent, [0])
    pid = agent.workers()[0]["pid"]
    kernel_log = cluster.tmp / f"{agent.node}.kern.log"

    outcome = agent.fault(kind="xid", code=79, gpu=2)
    lines = kernel_log.read_text().splitlines()
    assert len(lines) == 1
    # The driver's own format; GPU 2 at its synthetic (DGX H100) PCI address.
    expected = rf"\[ *\d+\.\d{{6}}\] NVRM: Xid \(PCI:0000:3a:00\): 79, pid={pid}, name=\S+, "
    assert re.fullmatch(expected + r"GPU has fallen off the bus\.", lines[0]), lines[0]
    assert str(kernel_log) in outcome["detail"]
    event = supervisor.wait_event(agent.node, "gpu_xid")
    assert event["details"]["code"] == 79 and event["details"]["gpu"] == 2
    assert "GPU has fallen off the bus." in event["details"]["message"]

    # A line written by "the kernel" in the older format, for a GPU we cannot map.
    with kernel_log.open("a") as f:
        f.write("[ 99.000001] NVRM: Xid (0000:86:00): 13, 0000 00000000 0000c5c0 00000520\n")
    wait_for(lambda: len(supervisor.events(agent.node, "gpu_xid")) == 2, 5, "second xid")
    # The same XID on the same GPU within the cooldown is reported once.
    agent.fault(kind="xid", code=79, gpu=2)
    agent.fault(kind="xid", code=48, gpu=2)
    wait_for(lambda: len(supervisor.events(agent.node, "gpu_xid")) == 3, 5, "third xid")
    time.sleep(0.5)
    events = supervisor.events(agent.node, "gpu_xid")
    assert [(e["details"]["code"], e["details"].get("gpu")) for e in events] == [
        (79, 2),
        (13, None),
        (48, 2),
    ]
    r = agent.api.post("/v1/faults", json={"kind": "xid"})
    assert r.status_code == 422 and r.json()["message"] == "code: required for an xid fault"


def test_ecc_faults_and_nvidia_smi_counts_reach_the_supervisor(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    csv = cluster.tmp / "ecc.csv"
    csv.write_text("0, 0\n1, [N/A]\n2, [Not Supported]\n")
    smi = cluster.tmp / "nvidia-smi"
    smi.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "if sys.argv[1] == '--query-gpu=index,pci.bus_id':\n"
        "    print('0, 00000000:18:00.0\\n1, 00000000:2A:00.0\\n2, 00000000:3A:00.0')\n"
        f"else:\n    sys.stdout.write(open({str(csv)!r}).read())\n"
    )
    smi.chmod(0o755)
    agent = cluster.start_agent(supervisor.url, nvidia_smi=smi, gpu_report_cooldown_s=0)
    supervisor.wait_event(agent.node, "spare_available")

    outcome = agent.fault(kind="ecc", gpu=1, count=2)
    assert outcome["detail"] == "synthetic uncorrected ECC count of gpu 1 is now 2"
    event = supervisor.wait_event(agent.node, "gpu_ecc")
    assert event["details"]["gpu"] == 1 and event["details"]["count"] == 2

    csv.write_text("0, 3\n1, [N/A]\n2, [Not Supported]\n")  # the GPU itself reports errors
    wait_for(lambda: len(supervisor.events(agent.node, "gpu_ecc")) == 2, 5, "second ecc")
    last = supervisor.events(agent.node, "gpu_ecc")[-1]["details"]
    assert (last["gpu"], last["count"], last["new_errors"]) == (0, 3, 3)
    r = agent.api.post("/v1/faults", json={"kind": "ecc"})
    assert r.status_code == 422 and r.json()["message"].startswith("count:")


def test_node_down_kills_everything_and_the_supervisor_notices(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    agent = cluster.start_agent(supervisor.url)
    cluster.start_workers(agent, [0, 1])
    cluster.wait_running(agent, [0, 1])
    wait_for(lambda: (supervisor.node(agent.node) or {}).get("state") == "running", 5, "running")

    outcome = agent.fault(kind="node_down")
    assert outcome["exiting"] is True
    assert agent.proc.wait(5) == 137
    wait_for(lambda: all(_pid_gone(p) for p in cluster.worker_pids()), 2, "workers killed")
    event = supervisor.wait_event(agent.node, "host_heartbeat_lost", within=5)
    assert event["node"] == agent.node
    # A dead node does not report its workers dying.
    assert supervisor.events(agent.node, "worker_exited") == []


def test_a_node_credential_heartbeats_and_cannot_speak_for_another_node(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    """A host monitor given only its own credential (`supervisor node-credential NODE`)
    heartbeats and forwards its workers' checkpoints; the same credential used for another
    node is refused (403, counted) and nothing of that node is stored."""
    node = f"hm-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    credential = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "node-credential", node],
        env={**env, "SUPERVISOR_NODE_KEY": NODE_KEY},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    agent = cluster.start_agent(
        supervisor.url,
        node=node,
        env={"HOST_MONITOR_AGENT_TOKEN": "", "HOST_MONITOR_NODE_CREDENTIAL": credential},
    )
    cluster.start_workers(agent, [40, 41], job="j4")
    cluster.wait_running(agent, [40, 41])

    def seen() -> bool:
        at = supervisor.node(node)
        return bool(at and at["job"] == "j4" and len(at["workers"]) == 2)

    wait_for(seen, 5, "the node's workers at the supervisor")
    report = {"event": "saved", "step": 3, "duration_s": 0.25, "tier": "ram"}
    assert agent.worker_api.post("/v1/workers/40/checkpoints", json=report).status_code == 202

    def forwarded() -> list[dict[str, Any]]:
        r = supervisor.http.get("/api/v1/checkpoints", params={"job": "j4"})
        reports: list[dict[str, Any]] = r.json() if r.status_code == 200 else []
        return reports

    [stored] = wait_for(forwarded, 5, "the checkpoint report forwarded")
    assert (stored["node"], stored["rank"], stored["step"]) == (node, 40, 3)

    intruder = {"node": "someone-else", "state": "spare"}
    r = http.post(
        f"{supervisor.url}/api/v1/heartbeats",
        json=intruder,
        headers={"Authorization": f"Bearer {credential}"},
    )
    assert r.status_code == 403
    assert (
        r.json()["message"] == f"node: 'someone-else' is not the node of this credential ('{node}')"
    )
    assert supervisor.node("someone-else") is None
    metrics = http.get(f"{supervisor.url}/metrics").text
    assert re.search(
        r'supervisor_agent_requests_refused_total\{reason="other_node"\} [1-9]', metrics
    )
    assert "retrying with backoff" not in agent.log.read_text()  # its own were all accepted


def test_agent_serves_without_supervisor_and_delivers_once_it_is_up(
    tmp_path: Path, cluster: Cluster
) -> None:
    port = free_port()
    agent = cluster.start_agent(f"http://127.0.0.1:{port}")
    # The local API works although no heartbeat gets through.
    cluster.start_workers(agent, [0])
    cluster.wait_running(agent, [0])
    agent.fault(kind="xid", code=79, gpu=1)  # queued until a heartbeat carrying it lands
    late = Supervisor(tmp_path, port=port)
    try:
        late.start()
        node = wait_for(lambda: late.node(agent.node), 5, "first heartbeat after backoff")
        assert node["state"] == "running" and node["alive"]
        wait_for(lambda: (late.node(agent.node) or {}).get("workers"), 5, "workers")
        xid = late.wait_event(agent.node, "gpu_xid")
        assert (xid["details"]["code"], xid["details"]["gpu"]) == (79, 1)
        # The agent logs the delivery once the answer is back: just after the supervisor
        # has stored what the heartbeat carried.
        wait_for(lambda: "heartbeat delivered to" in agent.log.read_text(), 5, "delivery line")
        log = agent.log.read_text()
        assert log.count("retrying with backoff") == 1, log  # one line, not one per attempt
    finally:
        late.stop()


def test_tokens_validation_and_startup_lines(supervisor: Supervisor, cluster: Cluster) -> None:
    agent = cluster.start_agent(supervisor.url, initial_state="running", job="j9")
    actuator, worker = agent.api, agent.worker_api
    assert actuator.get("/v1/status", headers={"Authorization": ""}).status_code == 401
    assert actuator.get("/v1/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert actuator.get("/v1/status", headers=WORKER).status_code == 401
    body = {"rank": 0, "local_rank": 0, "pid": 1}
    assert worker.post("/v1/workers/register", json=body, headers=ACTUATOR).status_code == 401
    assert http.post(f"{agent.url}/v1/workers/register", json=body).status_code == 401
    assert (
        actuator.post("/v1/faults", json={"kind": "node_down"}, headers=WORKER).status_code == 401
    )
    assert agent.proc.poll() is None

    r = worker.post("/v1/workers/register", json={**body, "rank": -1})
    assert r.status_code == 422 and r.json()["message"].startswith("rank:")
    r = worker.post("/v1/workers/3/progress", json={"step": 1})
    assert r.status_code == 404
    r = actuator.post("/v1/workers/stop", json={"grace_s": "soon"})
    assert r.status_code == 422 and "grace_s" in r.json()["message"]
    r = actuator.post("/v1/emergency-checkpoint", json={"request_id": "x"})
    assert r.status_code == 422 and "timeout_s" in r.json()["message"]

    # One clear line per absent GPU source, once.
    log = agent.log.read_text()
    assert log.count("ecc watchdog disabled: ") == 1, log
    assert "no-nvidia-smi-here not found on PATH" in log
    other = cluster.start_agent(supervisor.url, kernel_log=None)
    log = other.log.read_text()
    if os.access("/dev/kmsg", os.R_OK):
        assert "xid watchdog: reading /dev/kmsg" in log
    else:
        assert log.count("xid watchdog disabled: /dev/kmsg not readable") == 1, log


def process_state(pid: int) -> str:
    """R, S, T (stopped)... as /proc/<pid>/stat says."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_adopted_worker_straggler_and_exit(supervisor: Supervisor, cluster: Cluster) -> None:
    """A worker we did not launch (as in a Kubernetes pod) registers itself."""
    agent = cluster.start_agent(supervisor.url, initial_state="running", job="j2")
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        body = {"rank": 4, "local_rank": 0, "pid": sleeper.pid, "world_size": 8}
        r = agent.worker_api.post("/v1/workers/register", json=body)
        assert r.status_code == 200 and r.json()["state"] == "running"
        progress = agent.worker_api.post(
            "/v1/workers/4/progress", json={"step": 7, "compute_s": 0.125}
        )
        # Nothing asked of the worker; how long ago the supervisor last answered its host
        # monitor (the worker's lease, training/monitor_link/lease.py).
        assert progress.status_code == 200, progress.text
        answer = progress.json()
        assert set(answer) <= {"supervisor_heard_s"}, answer
        assert answer.get("supervisor_heard_s") is None or answer["supervisor_heard_s"] >= 0
        [status] = [w for w in agent.api.get("/v1/status").json()["workers"] if w["rank"] == 4]
        assert status["compute_s"] == 0.125  # passed on in the heartbeats

        # The straggler needs no help from the worker: it is stopped and continued.
        outcome = agent.fault(kind="straggler", rank=4, slowdown=1.0, duration_s=1.0)
        assert outcome["rank"] == 4 and "2 times slower" in outcome["detail"]
        wait_for(lambda: process_state(sleeper.pid) == "T", what="the sleeper stopped")
        wait_for(lambda: process_state(sleeper.pid) == "S", what="and continued")
        time.sleep(1.2)  # past duration_s: continued for good
        for _ in range(20):
            assert process_state(sleeper.pid) == "S"
            time.sleep(0.02)
        r = agent.api.post("/v1/faults", json={"kind": "straggler", "rank": 4, "slowdown": 0})
        assert r.status_code == 422 and r.json()["message"].startswith("slowdown:")
        agent.worker_api.post("/v1/workers/4/progress", json={"step": 8}).raise_for_status()
        report = {"event": "saved", "step": 8, "duration_s": 0.5, "tier": "local"}
        r = agent.worker_api.post("/v1/workers/4/checkpoints", json=report)
        assert r.status_code == 202
        # An older client's report: no size, no total time.
        old = {**report, "bytes": None, "total_s": None, "error": None}
        assert agent.api.get("/v1/checkpoints").json()[0]["report"] == old
        # The tiers of the PyTorch library, with the size and the time in all.
        sized = {**report, "tier": "ram", "bytes": 2**40, "total_s": 2.5, "error": None}
        loaded = {**sized, "event": "loaded", "tier": "peer", "duration_s": 1.0}
        for body in (sized, loaded):
            r = agent.worker_api.post("/v1/workers/4/checkpoints", json=body)
            assert r.status_code == 202, r.text
        assert [c["report"] for c in agent.api.get("/v1/checkpoints").json()] == [
            old,
            sized,
            loaded,
        ]
        for change, field in (
            ({"event": "failed"}, "error"),  # a failed save without its error
            ({"error": "no space left"}, "error"),  # an error on a save that committed
            ({"bytes": -1}, "bytes"),
            ({"bytes": 2**62 + 1}, "bytes"),
            ({"total_s": -1}, "total_s"),
            ({"total_s": 604_801}, "total_s"),
            ({"tier": "tape"}, "tier"),
        ):
            r = agent.worker_api.post("/v1/workers/4/checkpoints", json={**sized, **change})
            assert r.status_code == 422 and r.json()["message"].startswith(f"{field}:"), r.text
        r = agent.worker_api.post(
            "/v1/workers/4/checkpoints",
            content=json.dumps(sized).replace("2.5", "NaN"),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 422 and r.json()["message"].startswith("total_s:"), r.text
        for bad_key in ("short", "x" * 33, "not/a-key-at-all"):
            r = agent.worker_api.post(
                "/v1/workers/4/checkpoints", json=sized, headers={"Idempotency-Key": bad_key}
            )
            assert r.status_code == 422, r.text
            assert r.json()["message"].startswith("header.Idempotency-Key:"), r.text
        assert len(agent.api.get("/v1/checkpoints").json()) == 3  # none of those kept
        # A report sent again under its key (its answer was lost) is kept once.
        for _ in range(2):
            r = agent.worker_api.post(
                "/v1/workers/4/checkpoints", json=sized, headers={"Idempotency-Key": "k" * 32}
            )
            assert r.status_code == 202, r.text
        assert len(agent.api.get("/v1/checkpoints").json()) == 4

        sleeper.kill()
        sleeper.wait()
        wait_for(lambda: agent.workers()[4]["state"] == "exited", 5, "adopted worker exited")
        assert agent.workers()[4]["exit_code"] is None  # not our child: unknown
        event = supervisor.wait_event(agent.node, "worker_exited")
        assert event["rank"] == 4 and event["details"]["step"] == 8
        assert "exit_code" not in event["details"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sigterm_stops_launched_workers_and_exits_cleanly(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    agent = cluster.start_agent(supervisor.url, shutdown_grace_s=0.5)
    cluster.start_workers(agent, [0, 1], env={"IGNORE_TERM_RANKS": "1"})
    cluster.wait_running(agent, [0, 1])
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    assert all(_pid_gone(p) for p in cluster.worker_pids())
    assert "host monitor of " in agent.log.read_text()


def test_invalid_settings_stop_startup_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOST_MONITOR_")}
    run = subprocess.run(
        [sys.executable, "-m", "host_monitor.cli", "--node", "n1"],
        env={**env, "HOST_MONITOR_HEARTBEAT_POLLING_PERIOD_S": "abc"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "host-monitor: invalid setting 'heartbeat_polling_period_s': Input should be a valid "
        "number, unable to parse string as a number (got 'abc')"
    ]
    run = subprocess.run(
        [sys.executable, "-m", "host_monitor.cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "missing setting 'node'" in run.stderr


def test_status_json_round_trips(cluster: Cluster) -> None:
    """Without a supervisor the agent still serves its API (and says why it sends nothing)."""
    agent = cluster.start_agent(None)
    assert agent.status()["state"] == "spare"
    assert http.get(f"{agent.url}/healthz").json() == {"status": "ok", "node": agent.node}
    assert "supervisor_url not set" in agent.log.read_text()
    assert json.loads(json.dumps(agent.status()))["workers"] == []
