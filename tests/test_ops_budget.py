"""`supervisor describe job` says when the supervisor gave a job up, and why;
`supervisor reset-budget JOB` starts its budget over, recorded. Against a real
`supervisor serve`, fed real heartbeats."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from supervisor.ops.errors import ExitCode
from tests.test_e2e import serving
from tests.test_ops_cli import beat, cli, failed, ok


def worker(node: str, pid: int, state: str = "running", **extra: Any) -> dict[str, Any]:
    report = {"rank": 0, "local_rank": 0, "pid": pid, "state": state, "step": 7, **extra}
    return {"node": node, "state": "running", "job": "j1", "workers": [report]}


def test_describe_shows_a_job_given_up_and_reset_budget_heals_it_again(tmp_path: Path) -> None:
    with serving(
        tmp_path, heartbeat_polling_period_s=5, heartbeat_timeout_s=600, max_no_progress_restarts=1
    ) as server:
        beat(server, worker("n1", 100))
        # A restart that resumes at the same step and crashes again: no progress.
        for pid in (100, 200):
            beat(server, worker("n1", pid, "exited", exit_code=1))
            beat(server, worker("n1", pid + 100))
        deadline = time.monotonic() + 20
        while "given_up" not in (
            described := ok(cli(tmp_path, "describe", "job", "j1", server=server))
        ):
            assert time.monotonic() < deadline, described
            time.sleep(0.1)
        assert "1 remedies in a row were not followed by progress" in described
        assert "job_given_up" in described  # among its recent events

        out = ok(cli(tmp_path, "reset-budget", "j1", server=server))
        assert out.startswith("job j1: budget reset (it was given up), now running"), out
        described = ok(cli(tmp_path, "describe", "job", "j1", server=server))
        assert re.search(r"^state:\s+running$", described, re.M), described
        assert "job_budget_reset" in described
        failed(cli(tmp_path, "reset-budget", "nope", server=server), ExitCode.NOT_FOUND, "nope")
