"""A job's normal end on the local cluster (`supervisor demo`: real host monitors, real
workers of the NumPy and the PyTorch workload, a real `supervisor serve`): its workers
report finishing, its state reads finished, and nothing but the end happened: no hang
(whose timeout here is shorter than the end takes), no action."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.local.demo import LocalDemo
from tests.test_local_cluster import demos, wait_for, workload  # noqa: F401


@pytest.fixture
def start_demo(tmp_path: Path, workload: str) -> Iterator[Callable[..., LocalDemo]]:  # noqa: F811
    yield from demos(tmp_path, workload)


def demo_logs(demo: LocalDemo) -> list[str]:
    return [
        line
        # Not rglob over the run folder: the peer stores' directories come and go meanwhile.
        for log in [*demo.run_dir.glob("logs/*.log"), *demo.run_dir.glob("nodes/*/*.log")]
        for line in log.read_text(errors="replace").splitlines()
    ]


def test_a_normal_end_is_no_hang_and_takes_no_action(
    start_demo: Callable[..., LocalDemo],
) -> None:
    demo = start_demo(
        total_steps=60,
        supervisor_env={
            # Longer than a step or a save takes here (two ranks on two shared cores),
            # shorter than the torch workload's end (its last save, its output).
            "SUPERVISOR_HANG_TIMEOUT_S": "5",
            "SUPERVISOR_HANG_WARMUP_INTERVALS": "0",
        },
    )
    job = demo.options.job

    def state() -> str:
        return str(demo.api(f"/api/v1/jobs/{job}")["state"])

    wait_for(lambda: state() == "finished", 180, "the job finished")
    ended = [line for line in demo_logs(demo) if "done step=" in line]
    assert ended, "the workers wrote their output"
    events = demo.api("/api/v1/events", limit=1000)["items"]
    failures = [e for e in events if e["type"] not in ("spare_available", "node_recovered")]
    assert all(
        e["type"] == "worker_exited" and e["details"].get("exit_code") == 0 for e in failures
    ), failures
    assert demo.api("/api/v1/actions")["items"] == []
