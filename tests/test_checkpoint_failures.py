"""A checkpoint save that does not commit is never silent: the worker -> its host monitor ->
`supervisor serve`, all real processes.

A PyTorch job (the test DDP job, one rank, real DCP saves) whose durable directory breaks
mid-run (it becomes a file: a mount gone bad): every durable save after that fails. Each
failure is a `failed` checkpoint report, a `checkpoint_failed` event and a count in the
job's metrics; the RAM tier goes on committing and the newest-step metric says so; after
`max_consecutive_save_failures` failures in a row the job's `step_done` raises with the
cause, and the worker exits with it.
"""

from __future__ import annotations

import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.test_goodput_live import ROOT, start_server, stored
from tests.test_host_monitor import Cluster, wait_for
from tests.test_host_monitor import Supervisor as ServerProcess

RUNNER = f"""
import runpy, sys
sys.path.insert(0, {str(ROOT)!r})
runpy.run_module("tests.torch_jobs.checkpoint_job", run_name="__main__")
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    (tmp_path / "supervisor").mkdir()
    s = start_server(tmp_path / "supervisor")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    c.script.write_text(RUNNER)
    try:
        yield c
    finally:
        c.teardown()


def saves_failing(log: str) -> int:
    """How many saves in a row the job's CheckpointSavesFailing says failed (0: none said).

    Saves are written in the background and counted when they end; the count is checked
    between steps, so a loaded machine can end one more save before the check sees the
    limit: at least the limit, not exactly it. Python prints an uncaught exception's name
    and its message in separate writes, between which another thread's line may land."""
    found = re.search(r"(\d+) checkpoint saves in a row to the durable tier failed", log)
    return int(found.group(1)) if found and "CheckpointSavesFailing" in log else 0


def test_failed_saves_are_reported_counted_and_stop_the_job(
    tmp_path: Path, server: ServerProcess, cluster: Cluster
) -> None:
    job = f"jf-{uuid.uuid4().hex[:6]}"
    agent = cluster.start_agent(server.url)
    durable = tmp_path / "durable"
    cluster.start_workers(
        agent,
        [0],
        job=job,
        env={
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": "1",
            "JOB_STEPS": "200",
            "JOB_RESULT": str(tmp_path / "result.json"),
            "JOB_BREAK_DURABLE_AT": "7",
            "IN_MEMORY_CHECKPOINTING_FREQ": "5",
            "S3_CHECKPOINTING_FREQ": "5",
            "CHECKPOINT_RAM_DIR": str(tmp_path / "ram"),
            "CHECKPOINT_DURABLE_DIR": str(durable),
            "SYNC_FILES": "false",
            "ENABLE_PEER_CKPT": "false",
            "MAX_CONSECUTIVE_SAVE_FAILURES": "3",
            "PYTHONPATH": str(ROOT),
        },
    )

    def exited() -> dict[str, Any] | None:
        worker = agent.workers().get(0, {})
        return worker if worker.get("state") == "exited" else None

    worker = wait_for(exited, 120, "the worker to stop on its failing saves")
    assert worker["exit_code"] not in (0, None)
    assert not (tmp_path / "result.json").exists()  # it did not run to its end
    output = (cluster.tmp / "run" / f"{agent.node}.{job}.rank0.log").read_text()
    assert saves_failing(output) >= 3, output[-3000:]

    # Every failed save reached the supervisor: reports with their error...
    def failed_reports() -> list[dict[str, Any]] | None:
        failed = [r for r in stored(server, job) if r["event"] == "failed"]
        return failed if len(failed) >= 3 else None

    failed = wait_for(failed_reports, 20, "3 failed reports")
    assert {(r["tier"], r["node"], r["rank"]) for r in failed} == {("durable", agent.node, 0)}
    assert sorted(r["step"] for r in failed)[:3] == [10, 15, 20]
    assert all("NotADirectoryError" in r["error"] for r in failed), failed
    saved = {(r["tier"], r["step"]) for r in stored(server, job) if r["event"] == "saved"}
    assert {("ram", 5), ("durable", 5), ("ram", 10), ("ram", 20)} <= saved

    # ...each a checkpoint_failed event naming the node, rank, step and tier...
    events = server.http.get(
        "/api/v1/events", params={"job": job, "type": "checkpoint_failed", "limit": 100}
    ).json()["items"]
    got = sorted((e["details"]["step"], e["details"]["tier"], e["node"]) for e in events)
    assert got[:3] == [(step, "durable", agent.node) for step in (10, 15, 20)]
    assert all(e["details"]["error"] for e in events)

    # ...and the job's metrics: failures by tier, and the newest step of each tier.
    metrics = server.http.get("/metrics").text
    failures = _sample(metrics, "supervisor_job_checkpoint_failures_total", job, "durable")
    assert failures >= 3
    newest = _sample(metrics, "supervisor_job_checkpoint_newest_step", job, "durable")
    assert newest == 5.0  # the last durable save that committed
    assert _sample(metrics, "supervisor_job_checkpoint_newest_step", job, "ram") >= 20.0
    assert _sample(metrics, "supervisor_job_checkpoint_newest_timestamp_seconds", job, "ram") > 0


def _sample(metrics: str, name: str, job: str, tier: str) -> float:
    prefix = f'{name}{{job_name="{job}",tier="{tier}"}} '
    for line in metrics.splitlines():
        if line.startswith(prefix):
            return float(line.removeprefix(prefix))
    raise AssertionError(f"no {prefix!r} in /metrics")


def _free_port() -> int:
    from supervisor.local.ports import free_port

    return free_port()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-x", "-q"]))
