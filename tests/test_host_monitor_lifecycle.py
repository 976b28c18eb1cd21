"""A node's job as it goes on Kubernetes, for real: the host monitor starts as a spare,
worker processes it did not launch register with their job, get SIGTERM (pod deleted)
or SIGKILL (crash), and the node becomes a spare again once the job has left.

Real `host-monitor` processes, a real `supervisor serve`, and workers that are plain
processes using the real worker client (and the real demo workload), started by the test
as the kubelet would: the host monitor only knows them from their registrations. Where a
PID namespace can be made (`unshare`), a worker that is pid 1 of its own namespace (a
container's `exec python`) goes through the same path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.kube import objects as kube_objects
from supervisor.local.ports import free_port
from tests.test_host_monitor import (
    AGENT_TOKEN,
    WORKER_TOKEN,
    Agent,
    Cluster,
    Supervisor,
    wait_for,
)
from tests.test_host_monitor_pidns import CAN_UNSHARE, NamespacedProcess
from tests.test_workload import Job
from tests.timing import scaled
from training import worker_client
from training.monitor_link import stopping

REPO = Path(__file__).resolve().parents[1]

# A training worker as a user writes it, in a pod: the worker client from its env
# (RANK, HOST_MONITOR_URL, HOST_MONITOR_WORKER_TOKEN, HOST_MONITOR_JOB), a step every
# 50 ms. argv: OUT (a directory) and a mode: `default` leaves SIGTERM to the default
# action; `own-handler` installs its own SIGTERM handler before registering (as the demo
# workload does), which writes OUT/own-handler and exits 7.
WORKER_SCRIPT = r"""
import os, signal, sys, time
from pathlib import Path
from training.worker_client import WorkerClient

out, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "own-handler":
    def on_term(signum, frame):
        (out / "own-handler").write_text(str(signum))
        sys.exit(7)
    signal.signal(signal.SIGTERM, on_term)
client = WorkerClient.from_env(report_interval_s=0.1)
ok = client.register(attempts=1)
(out / "registered.tmp").write_text(f"{ok} {os.getpid()}")
os.replace(out / "registered.tmp", out / "registered")
if not ok:
    sys.exit(5)
step = 0
while True:
    step += 1
    client.report_step(step)
    time.sleep(0.05)
"""


class Workers:
    """Worker processes the test starts itself (the host monitor only adopts them)."""

    def __init__(self, tmp: Path, agent: Agent) -> None:
        self.tmp = tmp
        self.agent = agent
        self.procs: list[subprocess.Popen[bytes]] = []
        self.namespaced: list[NamespacedProcess] = []

    def env(self, rank: int, job: str | None) -> dict[str, str]:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HOST_MONITOR_")},
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "HOST_MONITOR_URL": self.agent.url,
            "HOST_MONITOR_WORKER_TOKEN": WORKER_TOKEN,
            "PYTHONPATH": str(REPO),
        }
        if job is not None:
            env[worker_client.ENV_JOB] = job
        return env

    def out(self, rank: int) -> Path:
        out = self.tmp / f"worker-{rank}-{len(self.procs) + len(self.namespaced)}"
        out.mkdir()
        out.chmod(0o777)
        return out

    def start(
        self, rank: int, job: str | None, mode: str = "default"
    ) -> tuple[subprocess.Popen[bytes], Path]:
        out = self.out(rank)
        with (out / "log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", WORKER_SCRIPT, str(out), mode],
                env=self.env(rank, job),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc, out

    def start_namespaced(self, rank: int, job: str) -> tuple[NamespacedProcess, Path]:
        out = self.out(rank)
        argv = [sys.executable, "-c", WORKER_SCRIPT, str(out), "default"]
        process = NamespacedProcess(argv, self.env(rank, job))
        self.namespaced.append(process)
        return process, out

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for process in self.namespaced:
            process.kill()


def registered(out: Path) -> bool:
    path = out / "registered"
    wait_for(path.exists, 20, f"{path}")
    ok = path.read_text().split()[0] == "True"
    assert ok, (out / "log").read_text()
    return ok


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    server = Supervisor(tmp_path_factory.mktemp("supervisor"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.teardown()


def worker_states(agent: Agent) -> dict[int, str]:
    return {rank: w["state"] for rank, w in agent.workers().items()}


def supervisor_view(supervisor: Supervisor, node: str) -> dict[str, Any]:
    view = supervisor.node(node)
    return view if view is not None else {}


def event_ranks(supervisor: Supervisor, node: str, type_: str) -> list[int | None]:
    return [e["rank"] for e in supervisor.events(node, type_)]


# --- joining ----------------------------------------------------------------------------


def test_a_spare_node_runs_the_job_its_first_worker_registers_with(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    # A long period: the supervisor can only learn of the job this fast from the
    # heartbeat a registration triggers at once.
    agent = cluster.start_agent(supervisor.url, heartbeat_polling_period_s=60)
    supervisor.wait_event(agent.node, "spare_available")
    workers = Workers(tmp_path, agent)
    try:
        sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
        workers.procs.append(sleeper)

        # An old client (no job) cannot make a spare run anything, and nothing changes.
        body: dict[str, Any] = {"rank": 0, "local_rank": 0, "pid": sleeper.pid}
        r = agent.worker_api.post("/v1/workers/register", json=body)
        assert r.status_code == 409, r.text
        assert r.json()["detail"].startswith("job: this node is a spare")
        assert "HOST_MONITOR_JOB" in r.json()["detail"]
        r = agent.worker_api.post("/v1/workers/register", json={**body, "job": "bad name"})
        assert r.status_code == 422 and r.json()["message"].startswith("job:")
        assert agent.status() == {"node": agent.node, "state": "spare", "job": None, "workers": []}

        # The worker client sends HOST_MONITOR_JOB: the spare now runs that job.
        _, out0 = workers.start(0, "pretrain")
        assert registered(out0)
        status = agent.status()
        assert (status["state"], status["job"]) == ("running", "pretrain")

        def joined() -> dict[str, Any] | None:
            view = supervisor_view(supervisor, agent.node)
            return view if view.get("job") == "pretrain" else None

        view = wait_for(joined, 10, "the supervisor sees the node running pretrain")
        assert view["state"] == "running"

        # Another job while a worker of this one lives: refused, naming both.
        r = agent.worker_api.post(
            "/v1/workers/register", json={**body, "rank": 1, "job": "finetune"}
        )
        assert r.status_code == 409, r.text
        detail = r.json()["detail"]
        assert "'pretrain'" in detail and "'finetune'" in detail and "ranks [0]" in detail
        # The same job, or no job (an older client) on a node that has one: accepted.
        r = agent.worker_api.post(
            "/v1/workers/register", json={**body, "rank": 1, "job": "pretrain"}
        )
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        other = subprocess.Popen(["sleep", "60"], start_new_session=True)
        workers.procs.append(other)
        r = agent.worker_api.post(
            "/v1/workers/register", json={"rank": 2, "local_rank": 2, "pid": other.pid}
        )
        assert r.status_code == 200, r.text
        assert agent.status()["job"] == "pretrain"
        assert sorted(agent.workers()) == [0, 1, 2]
    finally:
        workers.close()


# --- stopped on purpose, or not -----------------------------------------------------------


def test_sigterm_is_stopped_and_no_event_while_sigkill_is_exited(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    agent = cluster.start_agent(supervisor.url, idle_release_s=600)
    workers = Workers(tmp_path, agent)
    try:
        default, out0 = workers.start(0, "j1")
        own, out1 = workers.start(1, "j1", mode="own-handler")
        crash, out2 = workers.start(2, "j1")
        assert registered(out0) and registered(out1) and registered(out2)
        wait_for(
            lambda: worker_states(agent) == {0: "running", 1: "running", 2: "running"},
            10,
            "three workers running",
        )
        wait_for(
            lambda: len(supervisor_view(supervisor, agent.node).get("workers", [])) == 3,
            10,
            "the supervisor sees three workers",
        )

        # SIGTERM as kubelet sends it when the pod is deleted. The client reports, then
        # the process ends as it would have without the client: by the default action
        # (killed by SIGTERM), or through the program's own handler (exit 7).
        default.send_signal(signal.SIGTERM)
        own.send_signal(signal.SIGTERM)
        assert default.wait(10) == -signal.SIGTERM
        assert own.wait(10) == 7
        assert (out1 / "own-handler").read_text() == str(int(signal.SIGTERM))
        wait_for(
            lambda: worker_states(agent) == {0: "stopped", 1: "stopped", 2: "running"},
            10,
            "SIGTERMed workers stopped",
        )
        # A crash (SIGKILL: no handler runs) is still a failure.
        crash.kill()
        crash.wait(10)
        wait_for(lambda: worker_states(agent)[2] == "exited", 10, "killed worker exited")
        assert agent.workers()[2]["exit_code"] is None  # not our child: unknown

        event = supervisor.wait_event(agent.node, "worker_exited", within=10)
        assert event["rank"] == 2 and event["job"] == "j1"

        def seen() -> dict[int, str] | None:
            view = supervisor_view(supervisor, agent.node)
            states = {w["rank"]: w["state"] for w in view.get("workers", [])}
            return states if states == {0: "stopped", 1: "stopped", 2: "exited"} else None

        wait_for(seen, 10, "final states at the supervisor")
        # The stops came first: had they raised events, those would be there by now.
        assert event_ranks(supervisor, agent.node, "worker_exited") == [2]
        assert event_ranks(supervisor, agent.node, "worker_heartbeat_lost") == []
        log = agent.log.read_text()
        assert "rank 0 (pid" in log and "is stopping (signal 15)" in log
        # Nothing released: idle_release_s is long here.
        assert agent.status()["state"] == "running"
    finally:
        workers.close()


def test_stopping_reports_are_checked(cluster: Cluster, tmp_path: Path) -> None:
    agent = cluster.start_agent(None, initial_state="running", job="j1")
    workers = Workers(tmp_path, agent)
    try:
        sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
        workers.procs.append(sleeper)
        own_namespace = os.stat("/proc/self/ns/pid").st_ino  # the agent's too
        body = {"rank": 3, "local_rank": 0, "pid": sleeper.pid, "pid_namespace": own_namespace}
        assert agent.worker_api.post("/v1/workers/register", json=body).status_code == 200
        api = agent.worker_api
        # The previous process of the rank (an old pod still terminating) is not this one.
        r = api.post("/v1/workers/3/stopping", json={"pid": sleeper.pid + 1, "signal": 15})
        assert r.status_code == 409 and r.json()["detail"].startswith("pid: rank 3 is pid")
        r = api.post("/v1/workers/3/stopping", json={"pid": sleeper.pid, "pid_namespace": 1})
        assert r.status_code == 409  # the same pid in another namespace: another process
        assert api.post("/v1/workers/4/stopping", json={"pid": 1}).status_code == 404
        r = api.post("/v1/workers/3/stopping", json={"pid": 0})
        assert r.status_code == 422 and r.json()["message"].startswith("pid:")
        r = agent.api.post("/v1/workers/3/stopping", json={"pid": sleeper.pid})
        assert r.status_code == 401  # the actuator's token is not a worker's
        assert worker_states(agent) == {3: "running"}

        # Reported stopping: the exit is `stopped`, whatever the signal that ends it.
        r = api.post("/v1/workers/3/stopping", json={"pid": sleeper.pid, "signal": 15})
        assert r.status_code == 200 and r.json()["state"] == "running"
        sleeper.kill()
        sleeper.wait()
        wait_for(lambda: worker_states(agent) == {3: "stopped"}, 10, "reported worker stopped")
    finally:
        workers.close()


def test_a_stopping_report_waits_for_a_slow_host_monitor_within_its_bound(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A host monitor slow to answer (a node busy with its data loaders: here frozen for
    a second and a half) still gets the SIGTERMed worker's report before its exit, so the
    exit is `stopped`, not a crash. One that never answers holds the exit up for the
    report's bound, no longer."""
    agent = cluster.start_agent(None, initial_state="running", job="j1")
    assert agent.proc is not None
    workers = Workers(tmp_path, agent)
    try:
        slow, out0 = workers.start(0, "j1")
        frozen, out1 = workers.start(1, "j1")
        assert registered(out0) and registered(out1)
        wait_for(lambda: worker_states(agent) == {0: "running", 1: "running"}, 10, "both running")
        agent.proc.send_signal(signal.SIGSTOP)
        try:
            slow.send_signal(signal.SIGTERM)
            time.sleep(1.5)  # the fault: a host monitor this late to answer
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        assert slow.wait(scaled(10)) == -signal.SIGTERM
        wait_for(lambda: worker_states(agent)[0] == "stopped", 10, "the slow report's stop")
        assert "stopping report" not in (out0 / "log").read_text()

        agent.proc.send_signal(signal.SIGSTOP)
        try:
            frozen.send_signal(signal.SIGTERM)
            # Bounded: the worker ends while its host monitor is still frozen.
            bound = stopping.STOPPING_REPORT_BOUND_S
            assert frozen.wait(scaled(bound + 5)) == -signal.SIGTERM
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        assert "stopping report to host monitor failed" in (out1 / "log").read_text()
    finally:
        workers.close()


# --- leaving ----------------------------------------------------------------------------


def test_the_node_is_a_spare_again_once_its_job_left_and_the_supervisor_saw_it(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    agent = cluster.start_agent(supervisor.url, idle_release_s=1.5)
    supervisor.wait_event(agent.node, "spare_available")
    workers = Workers(tmp_path, agent)
    try:
        first, out0 = workers.start(0, "j1")
        crash, out1 = workers.start(1, "j1")
        assert registered(out0) and registered(out1)
        first.send_signal(signal.SIGTERM)
        first.wait(10)
        crash.kill()
        crash.wait(10)
        # Gone, not yet released: the node still says which job left and how.
        wait_for(
            lambda: worker_states(agent) == {0: "stopped", 1: "exited"}, 10, "both workers gone"
        )
        assert agent.status()["job"] == "j1"

        # Then a spare: no job, no workers, heartbeated (spare_available at the supervisor).
        wait_for(lambda: agent.status()["state"] == "spare", 15, "node released")
        assert agent.status() == {"node": agent.node, "state": "spare", "job": None, "workers": []}
        spare = wait_for(
            lambda: [e for e in supervisor.events(agent.node, "spare_available")][1:],
            10,
            "a second spare_available",
        )[0]
        # The supervisor saw the crash before the node released itself.
        (exited,) = supervisor.events(agent.node, "worker_exited")
        assert exited["rank"] == 1 and exited["id"] < spare["id"]
        view = supervisor_view(supervisor, agent.node)
        assert (view["state"], view["job"], view["workers"]) == ("spare", None, [])
        assert "job j1 left this node" in agent.log.read_text()

        # Spare again, it serves the next job that comes.
        _, out2 = workers.start(0, "j2")
        assert registered(out2)
        assert (agent.status()["state"], agent.status()["job"]) == ("running", "j2")
    finally:
        workers.close()


def test_a_registration_cancels_the_release(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    # The window the replacement has to register in: a margin of the test's (a worker's
    # start took over 2 s on a loaded machine), scaled with the others.
    release_s = scaled(2.0)
    agent = cluster.start_agent(supervisor.url, idle_release_s=release_s)
    workers = Workers(tmp_path, agent)
    try:
        old, out0 = workers.start(0, "j1")
        assert registered(out0)
        old.send_signal(signal.SIGTERM)
        old.wait(10)
        wait_for(lambda: worker_states(agent) == {0: "stopped"}, 10, "old pod's worker stopped")
        # The pod's replacement registers within idle_release_s (a JobSet restart).
        _, out1 = workers.start(0, "j1")
        assert registered(out1)
        # A negative: the release would have come at release_s; wait past it.
        time.sleep(release_s + 1.5)
        status = agent.status()
        assert (status["state"], status["job"]) == ("running", "j1")
        assert worker_states(agent) == {0: "running"}
        assert "left this node" not in agent.log.read_text()
        assert event_ranks(supervisor, agent.node, "worker_exited") == []
    finally:
        workers.close()


def test_no_release_before_a_heartbeat_carried_the_exits(cluster: Cluster, tmp_path: Path) -> None:
    """The supervisor is down when the job leaves: the node waits for it."""
    late = Supervisor(tmp_path)
    agent = cluster.start_agent(late.url, idle_release_s=0.5)
    workers = Workers(tmp_path, agent)
    try:
        crash, out0 = workers.start(0, "j1")
        assert registered(out0)
        crash.kill()
        crash.wait(10)
        wait_for(lambda: worker_states(agent) == {0: "exited"}, 10, "worker exited")
        time.sleep(2.0)  # well past idle_release_s; no heartbeat can be delivered
        assert agent.status()["state"] == "running"

        late.start()
        wait_for(lambda: agent.status()["state"] == "spare", 20, "released once delivered")
        (exited,) = wait_for(
            lambda: late.events(agent.node, "worker_exited"), 10, "the exit at the supervisor"
        )
        assert exited["rank"] == 0
    finally:
        workers.close()
        late.stop()


def test_workers_register_again_with_a_restarted_host_monitor(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    """A DaemonSet rollout restarts the host monitor under running pods: the new one
    starts as a spare and knows no worker until their next progress report (404) makes
    the worker client register again."""
    port = free_port()
    first = cluster.start_agent(supervisor.url, port=port)
    workers = Workers(tmp_path, first)
    try:
        worker, out = workers.start(0, "j1")
        assert registered(out)
        assert first.status()["job"] == "j1"
        os.killpg(first.proc.pid, signal.SIGKILL)  # not its adopted workers: other sessions
        first.proc.wait(10)

        second = cluster.start_agent(supervisor.url, port=port, node=first.node)
        assert second.url == first.url
        wait_for(
            lambda: second.status()["job"] == "j1" and worker_states(second) == {0: "running"},
            20,
            "the worker registered with the new host monitor",
        )
        assert worker.poll() is None
        # And its SIGTERM report reaches the new one.
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == -signal.SIGTERM
        wait_for(lambda: worker_states(second) == {0: "stopped"}, 10, "stopped")
    finally:
        workers.close()


# --- with the demo workload, and from a PID namespace -------------------------------------


def test_demo_workload_sigterm_composes_with_the_client_handler(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    """The workload's own SIGTERM handling (stop at a safe point, exit 143) still runs,
    after the client told the host monitor: the JobSet deletes both pods, no event."""
    agent = cluster.start_agent(supervisor.url, idle_release_s=1)
    job = Job(
        tmp_path / "workload",
        1,
        total=100_000,
        step_time_s=0.02,
        replicas=1,
        ranks=range(2),
        HOST_MONITOR_URL=agent.url,
        HOST_MONITOR_WORKER_TOKEN=WORKER_TOKEN,
        HOST_MONITOR_JOB="demo",
    )
    try:
        wait_for(
            lambda: (
                worker_states(agent) == {0: "running", 1: "running"}
                and all(len(job.steps(r)) >= 3 for r in (0, 1))
            ),
            60,
            "the workload training, registered",
        )
        assert agent.status()["job"] == "demo"
        for proc in job.procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = job.wait(30)
        assert codes == {0: 143, 1: 143}, {r: job.log(r)[-1000:] for r in codes}
        assert all("terminated by SIGTERM" in job.log(r) for r in (0, 1))
        wait_for(lambda: agent.status()["state"] == "spare", 20, "released after the job left")
        assert event_ranks(supervisor, agent.node, "worker_exited") == []
    finally:
        job.kill()


@pytest.mark.skipif(not CAN_UNSHARE, reason="cannot create a PID namespace here")
def test_pid_1_of_its_own_namespace_reports_stopping_too(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    """A container's `exec python` worker: pid 1 of its namespace, with no SIGTERM handler
    of its own. The kernel delivers SIGTERM to it only because the client installed one;
    the default action that follows is what pid 1 gets (nothing), so it lives on until
    SIGKILL, as kubelet would do after the grace period, and that exit is `stopped`."""
    agent = cluster.start_agent(supervisor.url, idle_release_s=600)
    workers = Workers(tmp_path, agent)
    try:
        process, out = workers.start_namespaced(0, "ns-job")
        assert registered(out)
        assert (out / "registered").read_text().split()[1] == "1"  # pid 1 in its namespace
        wait_for(lambda: worker_states(agent) == {0: "running"}, 10, "namespaced worker running")
        assert agent.workers()[0]["host_pid"] == process.host_pid

        os.kill(process.host_pid, signal.SIGTERM)
        wait_for(lambda: "is stopping (signal 15)" in agent.log.read_text(), 10, "stopping")
        assert worker_states(agent) == {0: "running"}  # still alive, as pid 1 would be
        os.kill(process.host_pid, signal.SIGKILL)
        wait_for(lambda: worker_states(agent) == {0: "stopped"}, 10, "stopped after SIGKILL")
        time.sleep(0.5)
        assert event_ranks(supervisor, agent.node, "worker_exited") == []
    finally:
        workers.close()


# --- the example JobSet -----------------------------------------------------------------


def test_example_jobset_gives_workers_their_job_name() -> None:
    path = REPO / "helm" / "resiliency-supervisor" / "examples" / "jobset.yaml"
    jobset = yaml.safe_load(path.read_text())
    (replicated,) = jobset["spec"]["replicatedJobs"]
    (trainer,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    env = {v["name"]: v for v in trainer["env"]}
    # The JobSet controller labels every pod with its JobSet's name: the job name the
    # supervisor's Kubernetes backend knows the job by.
    assert env[worker_client.ENV_JOB]["valueFrom"] == {
        "fieldRef": {"fieldPath": f"metadata.labels['{kube_objects.JOBSET_NAME}']"}
    }
    client = worker_client.WorkerClient.from_env(
        {worker_client.ENV_JOB: jobset["metadata"]["name"], "RANK": "0"}
    )
    assert client.job == "pretrain"
    client.close()


def test_launched_workers_know_their_job_and_are_not_released_by_the_monitor(
    cluster: Cluster,
) -> None:
    agent = cluster.start_agent(None, idle_release_s=0.1)
    cluster.start_workers(agent, [0], job="launched")
    cluster.wait_running(agent, [0])
    pid = agent.workers()[0]["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"HOST_MONITOR_JOB=launched" in environ
    assert agent.status()["job"] == "launched"
    assert AGENT_TOKEN.encode() not in b"".join(environ)
    r = agent.api.post("/v1/workers/stop", json={"grace_s": 1})
    assert r.status_code == 200, r.text
    assert worker_states(agent) == {0: "stopped"}
    # Launched workers are the actuator's to release (stop with `release`), never the
    # monitor's own doing: a negative, so wait well past idle_release_s.
    time.sleep(1.5)
    assert (agent.status()["state"], agent.status()["job"]) == ("running", "launched")
