"""A job's end through real processes: a worker using the worker client leaves its loop
and closes the client, its host monitor reports it `finishing`, the supervisor (a real
`supervisor serve`) shows the job finishing and takes no action, then finished."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_host_monitor import Cluster, Supervisor, wait_for
from tests.test_host_monitor_lifecycle import REPO, Workers, worker_states

# A worker as a user writes it: steps every 50 ms, then leaves its loop and takes a while
# to end (its last save, its output) with no step: longer than the supervisor's fixed
# hang timeout. `close()` reports finishing; then the process exits 0 when OUT/go exists.
FINISHING_WORKER = r"""
import sys, time
from pathlib import Path
from training.worker_client import WorkerClient

out = Path(sys.argv[1])
client = WorkerClient.from_env(report_interval_s=0.1)
assert client.register(attempts=5)
for step in range(1, 31):
    client.report_step(step)
    time.sleep(0.05)
client.close()
while not (out / "go").exists():
    time.sleep(0.05)
"""

# The same worker as the example workloads end: `finished()` once its output is written
# (the exit that follows is no failure), and exit 0.
ENDING_WORKER = FINISHING_WORKER + "client.finished()\n"


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    server = Supervisor(
        tmp_path,
        env={"SUPERVISOR_HANG_TIMEOUT_S": "0.5", "SUPERVISOR_HANG_WARMUP_INTERVALS": "0"},
    )
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


def test_a_worker_that_closes_its_client_is_finishing_and_no_hang(
    supervisor: Supervisor, cluster: Cluster, tmp_path: Path
) -> None:
    agent = cluster.start_agent(supervisor.url, idle_release_s=600)
    workers = Workers(tmp_path, agent)
    try:
        out = workers.out(0)
        with (out / "log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", FINISHING_WORKER, str(out)],
                env=workers.env(0, "j1"),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        workers.procs.append(proc)

        def job_state() -> str | None:
            r = supervisor.http.get("/api/v1/jobs/j1")
            return r.json()["state"] if r.status_code == 200 else None

        wait_for(lambda: job_state() == "running", 20, "the job running")
        wait_for(lambda: worker_states(agent) == {0: "finishing"}, 20, "the worker finishing")
        wait_for(lambda: job_state() == "finishing", 10, "the job finishing")
        # Several hang timeouts at the last step, finishing: no hang.
        for _ in range(30):
            assert job_state() == "finishing"
            time.sleep(0.05)
        (out / "go").write_text("")
        assert proc.wait(20) == 0, (out / "log").read_text()
        wait_for(lambda: job_state() == "finished", 10, "the job finished")
        assert supervisor.events(agent.node, "hang") == []
        assert supervisor.http.get("/api/v1/actions").json()["items"] == []
    finally:
        workers.close()


def test_a_job_that_ended_while_the_supervisor_was_down_is_finished_when_it_returns(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The supervisor never heard `finishing` (down, or starting slowly, while a short job
    ran to its end): the worker the host monitor launched exited 0 after finishing, which
    its later heartbeats carry: the job's end. Finished, no action."""
    supervisor = Supervisor(
        tmp_path,
        env={"SUPERVISOR_HANG_TIMEOUT_S": "0.5", "SUPERVISOR_HANG_WARMUP_INTERVALS": "0"},
    )
    agent = cluster.start_agent(supervisor.url, idle_release_s=600)
    try:
        out = tmp_path / "out"
        out.mkdir()
        (out / "go").write_text("")  # it ends as soon as it closes its client
        r = agent.api.post(
            "/v1/workers/start",
            json={
                "request_id": uuid.uuid4().hex,
                "job": "j1",
                "command": [sys.executable, "-c", ENDING_WORKER, str(out)],
                "env": {"PYTHONPATH": str(REPO)},
                "workers": [{"rank": 0, "local_rank": 0}],
            },
        )
        assert r.status_code == 200, r.text
        wait_for(lambda: worker_states(agent) == {0: "exited"}, 60, "the worker's end seen")
        assert agent.workers()[0]["exit_code"] == 0

        supervisor.start()

        def job_state() -> str | None:
            r = supervisor.http.get("/api/v1/jobs/j1")
            return r.json()["state"] if r.status_code == 200 else None

        wait_for(lambda: job_state() == "finished", 20, "the job finished")
        assert supervisor.http.get("/api/v1/actions").json()["items"] == []
    finally:
        supervisor.stop()
