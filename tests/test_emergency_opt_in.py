"""Emergency checkpoints are opt-in: the host monitor sends SIGUSR1 only to a worker that
said it handles it (the worker client says so once its handler is installed), and the
supervisor takes a job whose workers all said nothing as one that takes none: told once,
as information, never as a failed action."""

from __future__ import annotations

import io
import logging
import os
import sys
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from supervisor.domain import ActionType
from supervisor.local.backend import LocalBackend
from supervisor.local.cluster_state import ClusterState, JobSpec, NodeInfo
from supervisor.local.demo import LocalDemo
from supervisor.local.run import JobRun
from tests.conftest import SettingsFactory
from tests.kube.harness import action
from tests.test_host_monitor import Cluster, wait_for
from tests.test_worker_client import RecordingServer
from training.worker_client import WorkerClient

# A worker as a user writes it with the worker client. HANDLER_<rank>: "none" (registers
# only, as a job without the Checkpointer: SIGUSR1's default action would kill it),
# "before" (on_emergency_checkpoint, then register) or "after" (register, then
# serve_emergency_checkpoints, as the Checkpointer does).
WORKER = r"""
import os, time
from pathlib import Path
from training.worker_client import WorkerClient

rank = int(os.environ["RANK"])
out = Path(os.environ["OUT_DIR"])
Path(os.environ["PID_DIR"], str(os.getpid())).write_text(str(rank))
how = os.environ[f"HANDLER_{rank}"]
client = WorkerClient.from_env(report_interval_s=0.1)

def save():
    (out / f"saved-{rank}").write_text("7")
    return 7

if how == "before":
    client.on_emergency_checkpoint(save)
client.register()
if how == "after":
    client.serve_emergency_checkpoints(save)
(out / f"ready-{rank}").write_text(str(os.getpid()))
step = 0
while True:
    client.at_safe_point()
    client.report_step(step)
    step += 1
    time.sleep(0.05)
"""

#: When the actions `supervisor run` tells of ended (the API's time, UTC).
ENDED = datetime(2026, 11, 29, 21, 5, 7, tzinfo=UTC)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.teardown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_only_workers_that_handle_sigusr1_are_signalled(cluster: Cluster, tmp_path: Path) -> None:
    agent = cluster.start_agent(None)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "user_worker.py"
    script.write_text(WORKER)
    handlers = {"HANDLER_0": "none", "HANDLER_1": "before", "HANDLER_2": "after"}
    body = {
        "request_id": uuid.uuid4().hex,
        "job": "j1",
        "command": [sys.executable, str(script)],
        "env": {"OUT_DIR": str(out), "PID_DIR": str(cluster.pid_dir), **handlers},
        "workers": [{"rank": r, "local_rank": r} for r in range(3)],
    }
    r = agent.api.post("/v1/workers/start", json=body)
    assert r.status_code == 200, r.text
    # Ready: registered, and a handler installed after registering was told too.
    wait_for(lambda: all((out / f"ready-{r}").exists() for r in range(3)), 15, "workers ready")
    pids = {r: int((out / f"ready-{r}").read_text()) for r in range(3)}

    r = agent.api.post("/v1/emergency-checkpoint", json={"request_id": "ec-1", "timeout_s": 5})
    assert r.status_code == 200, r.text
    result = r.json()
    assert sorted(result["acked"]) == ["1", "2"], result
    assert all(a["ok"] and a["step"] == 7 for a in result["acked"].values())
    assert result["missing"] == [] and result["declined"] == [0], result
    assert sorted(p.name for p in out.glob("saved-*")) == ["saved-1", "saved-2"]
    # The worker without a handler was never signalled: it trains on.
    assert _alive(pids[0]), agent.log.read_text()
    assert agent.workers()[0]["state"] == "running"


def test_the_client_tells_its_host_monitor_when_its_handler_comes_and_goes() -> None:
    server = RecordingServer()
    client = WorkerClient(5, 0, monitor_url=server.url, report_interval_s=3600)
    try:
        assert client.register(attempts=1)
        assert "emergency_checkpoints" not in server.bodies("/v1/workers/register")[0]
        client.on_emergency_checkpoint(lambda: 1)
        client.close()  # puts SIGUSR1's handler back: no longer signalled
        pid = {"pid": os.getpid(), "pid_namespace": os.stat("/proc/self/ns/pid").st_ino}
        assert server.bodies("/v1/workers/5/emergency-checkpoints") == [
            {**pid, "emergency_checkpoints": True},
            {**pid, "emergency_checkpoints": False},
        ]
    finally:
        client.close()
        server.close()


def _result(declined: list[int], unregistered: list[int] | None = None) -> dict[str, Any]:
    return {
        "request_id": "k",
        "acked": {},
        "missing": [],
        "elapsed_s": 0.01,
        "declined": declined,
        "unregistered": unregistered or [],
    }


async def test_a_job_that_takes_none_is_told_once_as_information_not_a_failure(
    tmp_path: Path, make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    nodes = {n: NodeInfo(address=f"http://{n}") for n in ("node-0", "node-1")}
    job = JobSpec(
        name="train",
        command=["train.py"],
        num_dp_replicas=2,
        num_nodes_per_dp=1,
        placement=list(nodes),
        nproc_per_node=2,
    )
    ClusterState(run_dir=str(run_dir), actuator_token="t", nodes=nodes, job=job).save()
    answers = {"node-0": _result([0, 1]), "node-1": _result([2], unregistered=[3])}
    backend = LocalBackend(run_dir, make_settings(emergency_checkpoint_timeout_s=2))
    await backend.cluster.close()
    # Each node's host monitor, as it answers for workers registered without a handler.
    backend.cluster._http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json=answers[r.url.host]))
    )
    note = (
        "job train takes no emergency checkpoints: no worker of it on node-0 (ranks 0, 1), "
        "node-1 (ranks 2, 3; rank 3 not registered yet) registered for emergency checkpoints"
    )
    try:
        with caplog.at_level(logging.DEBUG, logger="supervisor.local.cluster"):
            first = await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, key="k1"))
            second = await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, key="k2"))
    finally:
        await backend.close()
    # Not an ActionError: the actuator records it succeeded, and the remedy goes on.
    for result in (first, second):
        assert result["emergency_checkpoints"] is False and result["note"] == note
        assert result["step"] is None and result["acked_ranks"] == []
    levels = [r.levelno for r in caplog.records if note in r.getMessage()]
    assert levels == [logging.INFO, logging.DEBUG]  # told once

    # `supervisor run` says it once, as information, among the actions it tells.
    out = io.StringIO()
    demo = SimpleNamespace(run_dir=tmp_path, options=SimpleNamespace(job="train"))
    run = JobRun(cast(LocalDemo, demo), out)

    def finished(id_: int, type_: str, result: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "id": id_,
            "type": type_,
            "status": "succeeded",
            "job": "train",
            "node": None,
            "reason": "why",
            "error": None,
            "result": dict(result),
            "finished_at": ENDED.isoformat(),
        }

    actions = [
        finished(4, "restart_in_place", {"path": "full_restart"}),
        finished(3, "emergency_checkpoint", second),
        finished(2, "restart_in_place", {"path": "full_restart"}),
        finished(1, "emergency_checkpoint", first),
    ]
    assert run._tell_actions(actions) is False
    # Each line starts with when the action ended, in local time.
    assert [line.split(" ", 1)[1] for line in out.getvalue().splitlines()] == [
        f"[supervisor]: emergency_checkpoint: {note}",
        "[supervisor]: restart_in_place succeeded by restarting every rank: why",
        "[supervisor]: restart_in_place succeeded by restarting every rank: why",
    ]
    stamps = {line.split(" ", 1)[0] for line in out.getvalue().splitlines()}
    assert stamps == {ENDED.astimezone().strftime("%H:%M:%S")}, stamps
