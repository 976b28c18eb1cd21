"""A rank cut off from the supervisor stops itself (training/monitor_link/lease.py).

Real processes: `supervisor serve`, a `host-monitor`, and a worker started by it that
trains with the real `WorkerClient.from_env` (a short lease, `HOST_LEASE_S`). Each step
it tries a durable write as the checkpoint saver does (`check_lease` before it commits)
and logs each write committed or refused. Its host monitor frozen (SIGSTOP), or its
supervisor silent (SIGSTOP: no answer, as a network cut gives), the worker's durable
writes are refused once the lease ran out, and it exits with LEASE_EXIT_CODE within the
lease and one report interval of the supervisor's last answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_host_monitor import Agent, Cluster, Supervisor, wait_for
from training.worker_client import LEASE_EXIT_CODE

LEASE_S = 2.0
REPORT_INTERVAL_S = 0.2

# Trains (a step every 50 ms); each step, a durable write the way the saver guards it.
WORKER = r"""
import os, sys, time
from pathlib import Path
from training.worker_client import HostLeaseExpired, WorkerClient

log = Path(os.environ["LEASE_LOG"])
client = WorkerClient.from_env(report_interval_s=float(os.environ["REPORT_INTERVAL_S"]))
client.register(world_size=1)
step = 0
while True:
    step += 1
    try:
        client.check_lease(f"the durable commit of step {step}")
        with log.open("a") as f:
            f.write(f"{time.monotonic()} committed {step}\n")
    except HostLeaseExpired as exc:
        with log.open("a") as f:
            f.write(f"{time.monotonic()} refused {step} {exc}\n")
    try:
        client.report_step(step)
    except HostLeaseExpired:
        pass  # the process ends with LEASE_EXIT_CODE all the same: the write stays refused
    time.sleep(0.05)
"""


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Supervisor, Cluster, Agent]]:
    server = Supervisor(tmp_path)
    server.start()
    cluster = Cluster(tmp_path)
    try:
        agent = cluster.start_agent(server.url, node="lease-node")
        yield server, cluster, agent
    finally:
        stopped = [a.proc.pid for a in cluster.agents]
        if server.proc is not None:
            stopped.append(server.proc.pid)
        for pid in stopped:  # continued, so that they can be stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cluster.teardown()
        server.stop()


def start_worker(cluster: Cluster, agent: Agent) -> Path:
    script = cluster.tmp / "lease_worker.py"
    script.write_text(WORKER)
    log = cluster.tmp / "lease.log"
    body = {
        "request_id": "lease-1",
        "job": "j1",
        "command": [sys.executable, str(script)],
        "env": {
            "LEASE_LOG": str(log),
            "HOST_LEASE_S": str(LEASE_S),
            "REPORT_INTERVAL_S": str(REPORT_INTERVAL_S),
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        },
        "workers": [{"rank": 0, "local_rank": 0}],
    }
    r = agent.api.post("/v1/workers/start", json=body)
    assert r.status_code == 200, r.text
    return log


def lines(log: Path) -> list[tuple[float, str]]:
    if not log.exists():
        return []
    return [
        (float(t), rest)
        for t, _, rest in (ln.partition(" ") for ln in log.read_text().splitlines())
    ]


def worker_pid(agent: Agent) -> int:
    workers = agent.workers()
    return int(workers[0]["pid"])


def exit_status(agent: Agent, pid: int, within: float) -> int | None:
    """The worker's exit status: from /proc while its frozen host monitor has not reaped
    it (a zombie: field 52 of its stat), else as its host monitor reports it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            code = wait_for(lambda: agent.workers()[0].get("exit_code") is not None, 5, "exit")
            return int(agent.workers()[0]["exit_code"]) if code else None
        if stat[0] == "Z":
            return int(stat[49]) >> 8
        time.sleep(0.02)
    return None


@pytest.mark.parametrize("frozen", ["host_monitor", "supervisor"])
def test_a_rank_cut_off_refuses_durable_writes_and_exits(
    setup: tuple[Supervisor, Cluster, Agent], frozen: str
) -> None:
    server, cluster, agent = setup
    log = start_worker(cluster, agent)
    wait_for(lambda: len(lines(log)) >= 20, 15, "the worker to train")
    pid = worker_pid(agent)
    # A lease armed and renewed: nothing refused while the supervisor answers.
    time.sleep(LEASE_S + 0.5)
    assert all("committed" in rest for _, rest in lines(log)), lines(log)[-3:]
    target = agent.proc.pid if frozen == "host_monitor" else server.proc.pid  # type: ignore[union-attr]
    cut_at = time.monotonic()
    os.kill(target, signal.SIGSTOP)
    status = exit_status(agent, pid, within=LEASE_S + 10)
    ended = time.monotonic()
    assert status == LEASE_EXIT_CODE, (status, lines(log)[-3:])
    seen = lines(log)
    refused = [(t, rest) for t, rest in seen if rest.startswith("refused")]
    committed = [t for t, rest in seen if rest.startswith("committed")]
    assert refused, seen[-3:]
    assert "host_lease_s=2" in refused[0][1], refused[0]
    # Nothing committed after the first refusal, nor later than the lease after the cut.
    assert max(committed) < refused[0][0]
    assert max(committed) <= cut_at + LEASE_S + 0.1
    # It stopped within the lease and one report interval of the cut (and margin).
    assert ended - cut_at <= LEASE_S + REPORT_INTERVAL_S + 5, ended - cut_at
